"""The library as a vLLM user writes it: vLLM's option and sampling names, its call shapes and
its result's shape, each mapped onto what the engine already has; bad input refused at the call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT
from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.contracts import GuidedDecodingParams, StructuredOutputsParams
from minivllm.sampling import min_p_filter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB", seed=7)
    yield engine
    engine.close()


def test_vllm_spellings_come_from_the_options_table():
    assert EngineConfig.vllm_names() == {"kv_cache_memory_bytes": "kv_memory",
                                         "enable_prefix_caching": "prefix_caching", "quantization": "quant"}
    assert EngineConfig(kv_memory="96MB").kv_memory == 96 << 20
    with pytest.raises(ValueError, match="kv_memory: not a memory size"):
        EngineConfig(kv_memory="lots")
    for foreign in ("awq", "gptq", "fp8"):
        with pytest.raises(ValueError, match=f"vLLM's quantization.*{foreign}.*quantised elsewhere"):
            EngineConfig(quant=foreign)


def test_bad_engine_keywords_are_refused_before_loading():
    with pytest.raises(TypeError, match="structured_output must be"):
        LLM(structured_output=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'trust_remote_cod'"):
        LLM(trust_remote_cod=True)
    with pytest.raises(TypeError, match="both prefix_caching= and vLLM's spelling"):
        LLM(prefix_caching=True, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="quantised elsewhere"):
        LLM(quantization="awq")
    with pytest.raises(ValueError, match="max_model_len must be"):
        LLM(max_model_len=0)


def test_vllm_keywords_build_the_same_engine(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cpu", kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True,
             max_model_len=40) as engine:
        assert engine.prefix_caching and engine.config.kv_memory == 8 << 20
        assert engine.capabilities().context_length == 40
        with pytest.raises(ValueError, match="maximum context length is 40"):
            engine.generate(PROMPT, SamplingParams(max_tokens=36))
    with pytest.raises(ValueError, match="at most the model's context window, 512"):
        LLM(str(tiny_model_dir), device="cpu", max_model_len=513)


def test_generate_takes_vllms_call_and_gives_vllms_shape(llm):
    sp = SamplingParams(max_tokens=5, logprobs=1)
    single = llm.generate(PROMPT, sampling_params=sp)
    assert single.outputs[0].text == single.text and single.outputs[0].token_ids == single.output_ids
    assert single.outputs[0].finish_reason == single.finish_reason == "length" and single.outputs[0].index == 0
    assert single.outputs[0].cumulative_logprob == pytest.approx(sum(e.logprob for e in single.logprobs))
    assert single.prompt == PROMPT and single.prompt_token_ids == llm.tokenizer(PROMPT).input_ids
    assert single.prompt_logprobs is None
    prompts = [PROMPT, {"prompt": "Hello"}, {"prompt_token_ids": single.prompt_token_ids}]
    each = [SamplingParams(max_tokens=n) for n in (2, 3, 4)]
    results = llm.generate(prompts, each)
    assert [len(r.outputs[0].token_ids) for r in results] == [2, 3, 4]
    assert results[2].prompt is None and results[2].output_ids == results[0].output_ids + results[2].output_ids[2:]
    assert llm.generate(prompts, sampling_params=sp)[0].text == single.text
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(prompts, each[:2])
    with pytest.raises(ValueError, match="'prompt' \\(text\\) or 'prompt_token_ids'"):
        llm.generate({"text": "hi"})


def test_engine_seed_makes_a_script_repeatable(tiny_model_dir):
    sp = SamplingParams(temperature=1.0, max_tokens=6)
    runs = []
    for _ in range(2):                     # the same script, run twice
        with LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB", seed=7) as engine:
            runs.append([r.output_ids for r in engine.generate([PROMPT] * 3, sp)])
    assert runs[0] == runs[1] and len({tuple(ids) for ids in runs[0]}) > 1   # repeatable, yet not one stream
    own = SamplingParams(temperature=1.0, max_tokens=6, seed=3)   # a request's own seed wins
    with LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB", seed=7) as engine:
        assert engine.generate(PROMPT, own).output_ids == engine.generate(PROMPT, own).output_ids


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=8))
    stopper = free.output_ids[2]
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=[stopper]))
    first = free.output_ids.index(stopper)
    assert stopped.output_ids == free.output_ids[:first + 1] and stopped.finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stopper
    assert stopped.text == llm.tokenizer.decode(free.output_ids[:first], skip_special_tokens=True)
    held = llm.generate(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=[stopper], min_tokens=first + 1))
    assert len(held.output_ids) > first + 1 and stopper not in held.output_ids[:first + 1]
    # a stop string that appears in the first tokens is not honoured before min_tokens
    text = llm.tokenizer.decode(free.output_ids[:2], skip_special_tokens=True)
    word = text.strip()[:3] or text
    assert llm.generate(PROMPT, SamplingParams(max_tokens=8, stop=[word])).finish_reason == "stop"
    late = llm.generate(PROMPT, SamplingParams(max_tokens=8, stop=[word], min_tokens=8))
    assert late.output_ids == free.output_ids and late.finish_reason == "length"


def test_min_tokens_holds_eos_back(llm):
    eos = sorted(llm.output.eos_token_ids)[0]
    bias = SamplingParams(max_tokens=6, logit_bias={eos: 100})   # EOS first, unless held back
    assert len(llm.generate(PROMPT, bias).output_ids) == 1
    held = llm.generate(PROMPT, SamplingParams(max_tokens=6, logit_bias={eos: 100}, min_tokens=3))
    assert len(held.output_ids) == 4 and held.output_ids[-1] == eos and held.finish_reason == "stop"


def test_min_p_filters_relative_to_the_likeliest():
    import torch

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = min_p_filter(logits, 0.3).isfinite()[0].tolist()
    assert kept == [True, True, True, False]             # 0.05 < 0.3 * 0.5
    assert min_p_filter(logits, 0.0) is logits
    with pytest.raises(ValueError, match="min_p must be between 0 and 1"):
        SamplingParams(min_p=1.5)


def test_vllms_structured_output_spellings():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    new = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    old = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert new.structured == SamplingParams(structured={"json_schema": schema}).structured
    assert old.structured == ("choice", ("yes", "no"))
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": schema})
    with pytest.raises(ValueError, match="min_tokens does not combine"):
        SamplingParams(min_tokens=2, structured={"regex": "a+"})


def test_chat_refuses_a_message_without_content(llm):
    with pytest.raises(ValueError, match=r"messages\[0\] has no 'content'"):
        llm.chat([{"role": "user"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a string"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": 5}])


SIGINT_SCRIPT = """
import sys
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", kv_memory="8MB")
print("READY", flush=True)
while True:                                  # never closed: Ctrl-C must still end it cleanly
    llm.generate(["Hello"] * 4, SamplingParams(max_tokens=64, ignore_eos=True))
"""


def default_sigint() -> None:
    """In the child, before exec: Ctrl-C as a terminal delivers it. A test earlier in the same pytest
    process (Ray's) may have left SIGINT ignored, and an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_without_close_exits_130_leaving_no_child(tiny_model_dir):
    child = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT, str(tiny_model_dir)], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                             preexec_fn=default_sigint)
    try:
        while "READY" not in child.stdout.readline():
            assert child.poll() is None, child.stderr.read()[-2000:]
        time.sleep(0.5)                          # inside a generate
        child.send_signal(signal.SIGINT)
        rc = child.wait(timeout=60)
        assert rc in (-signal.SIGINT, 130), (rc, child.stderr.read()[-2000:])   # 130: the shell's reading
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-g", str(child.pid)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes left behind: {left}"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)


STUCK_SCRIPT = """
import sys, threading, time
import minivllm.engine_loop as engine_loop
from minivllm import LLM, SamplingParams
engine_loop.EXIT_JOIN_S = 1.0
llm = LLM(sys.argv[1], device="cpu", kv_memory="8MB")
def step_forever():                      # a step that never returns (a hung kernel, a dead peer)
    print("READY", flush=True)
    threading.Event().wait()
llm.step = step_forever
llm.generate(["Hello"], SamplingParams(max_tokens=8))
"""


def test_ctrl_c_during_a_step_that_never_returns_still_exits_130(tiny_model_dir):
    child = subprocess.Popen([sys.executable, "-c", STUCK_SCRIPT, str(tiny_model_dir)], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                             preexec_fn=default_sigint)
    try:
        while "READY" not in child.stdout.readline():
            assert child.poll() is None, child.stderr.read()[-2000:]
        child.send_signal(signal.SIGINT)
        rc = child.wait(timeout=60)
        assert rc == 130, (rc, child.stderr.read()[-2000:])
        assert "did not stop within 1 s" in child.stderr.read()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
