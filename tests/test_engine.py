"""04_engine.py: the interface, and the baseline engine's behaviour."""

import inspect

import pytest
import torch

from conftest import load_script
from kit.demo import demo, demo_parser, metric_lines, print_streamed
from kit.engines import load_engine
from minivllm.contracts import BaseOfflineEngine, RequestMetrics, SamplingParams
from minivllm.text import IncrementalDetokenizer, render_chat, tokenize

engine_mod = load_script("04_engine")


# ------------------------------------------------------------------ the contract
def test_a_subclass_missing_a_method_cannot_be_built():
    class OnlyGenerate(BaseOfflineEngine):
        def generate(self, prompt, max_new_tokens, params=None):
            return None

    with pytest.raises(TypeError, match="generate_batch"):
        OnlyGenerate()
    with pytest.raises(TypeError):
        BaseOfflineEngine()


def test_baseline_is_an_offline_engine(tiny_engine):
    assert isinstance(tiny_engine, BaseOfflineEngine)
    assert not tiny_engine.model.training  # eval mode


# ------------------------------------------------------------------ behaviour on the tiny model
def test_greedy_is_deterministic(tiny_engine, reference_prompts):
    for prompt in reference_prompts[:3]:
        a = tiny_engine.generate(prompt, 12)
        b = tiny_engine.generate(prompt, 12, SamplingParams())
        assert a.output_ids == b.output_ids and a.text == b.text


def test_seeded_sampling_is_reproducible(tiny_engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    runs = [tiny_engine.generate("Once upon a time", 16, params).output_ids for _ in range(2)]
    assert runs[0] == runs[1]
    others = {tuple(tiny_engine.generate("Once upon a time", 16, SamplingParams(temperature=1.0, seed=s))
                    .output_ids) for s in range(4)}
    assert len(others) > 1  # the seed actually matters


def test_metrics_are_consistent(tiny_engine):
    prompt = "The capital of France is"
    result = tiny_engine.generate(prompt, 10)
    metrics = result.metrics
    assert metrics.output_tokens == len(result.output_ids) <= 10
    assert metrics.input_tokens == len(tiny_engine.tokenizer(prompt).input_ids)
    assert metrics.throughput > 0
    assert metrics.ttft_ms is None and metrics.tpot_ms is None  # invisible inside HF generate
    assert result.text == tiny_engine.tokenizer.decode(result.output_ids, skip_special_tokens=True)


def test_generate_batch_equals_mapping_generate(tiny_engine, reference_prompts):
    prompts = reference_prompts[:4]
    batch = tiny_engine.generate_batch(prompts, 8)
    single = [tiny_engine.generate(p, 8) for p in prompts]
    assert [r.output_ids for r in batch] == [r.output_ids for r in single]
    assert [r.text for r in batch] == [r.text for r in single]
    assert tiny_engine.generate_batch([], 8) == []


def test_generate_batch_refuses_a_bad_prompt_before_any_work(tiny_engine, monkeypatch):
    generated = []
    monkeypatch.setattr(tiny_engine, "generate", lambda p, *a, **k: generated.append(p))
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_engine.generate_batch(["Hello", "Hi", "word " * 600], 8)
    assert generated == []
    with pytest.raises(ValueError, match="list of strings"):
        tiny_engine.generate_batch("Hello", 8)


def test_max_tokens_caps_the_budget(tiny_engine):
    result = tiny_engine.generate("Hello", 20, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(result.output_ids) == 3 and result.finish_reason == "length"


def test_ignore_eos_generates_exactly_the_budget(tiny_engine):
    eos = next(iter(tiny_engine.eos_token_ids))
    result = tiny_engine.generate("Hello", 30, SamplingParams(ignore_eos=True))
    assert len(result.output_ids) == 30 and result.finish_reason == "length"
    assert result.metrics.output_tokens == 30
    assert isinstance(eos, int)


def test_stop_string_cuts_text_and_sets_finish_reason(tiny_engine):
    free = tiny_engine.generate("The capital of France is", 24, SamplingParams(ignore_eos=True))
    assert len(free.text) > 6
    stop = free.text[3:6]  # a string we know appears in the free-running output
    cut = tiny_engine.generate("The capital of France is", 24, SamplingParams(stop=[stop], ignore_eos=True))
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and free.text.startswith(cut.text)
    assert cut.output_ids == free.output_ids[: len(cut.output_ids)]


def test_stream_pieces_join_to_the_same_result(tiny_engine, reference_prompts):
    for prompt in reference_prompts[:3]:
        expected = tiny_engine.generate(prompt, 16)
        *pieces, final = list(tiny_engine.generate_stream(prompt, 16))
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == expected.text == final.text
        assert final.output_ids == expected.output_ids
        assert final.finish_reason == expected.finish_reason


def test_closing_a_stream_early_stops_generation(tiny_engine):
    stream = tiny_engine.generate_stream("Once upon a time", 400, SamplingParams(ignore_eos=True))
    next(stream)
    stream.close()  # must return promptly and leave the engine usable
    assert tiny_engine.generate("Hi", 4).metrics.output_tokens <= 4


def test_an_error_in_the_stream_worker_reaches_the_consumer(tiny_engine, monkeypatch):
    def broken_generate(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(tiny_engine.model, "generate", broken_generate)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(tiny_engine.generate_stream("Hi", 4))


def test_incremental_detokenizer_holds_back_partial_stop_strings(tiny_engine):
    tok = tiny_engine.tokenizer
    detok = IncrementalDetokenizer(tok, stop=["END"])
    pieces = [detok.add(i) for i in tok("Hello there EN").input_ids]
    assert "".join(pieces) == "Hello there "  # ' EN' might become ' END', so it waits
    assert detok.flush() == "EN" and not detok.stopped


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("prompt, max_new_tokens, match", [
    ("", 10, "prompt"),
    ("Hello", 0, "max_new_tokens"),
    ("Hello", -5, "max_new_tokens"),
    ("Hello", 10_000, "maximum context length"),
    ("word " * 600, 10, "maximum context length"),
    ("a\ud800b", 10, "lone surrogate"),
    ("Hello", float("nan"), "max_new_tokens"),     # NaN fails every comparison: it would never stop
    ("Hello", 1.5, "max_new_tokens"),
    ("Hello", True, "max_new_tokens"),
    ("Hello", None, "max_new_tokens"),
])
def test_bad_requests_raise_value_error(tiny_engine, prompt, max_new_tokens, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate(prompt, max_new_tokens)


def test_context_error_states_both_lengths(tiny_engine):
    prompt = "word " * 600
    n_prompt = len(tiny_engine.tokenizer(prompt).input_ids)
    with pytest.raises(ValueError) as info:
        tiny_engine.generate(prompt, 10)
    message = str(info.value)
    assert f"maximum context length is {tiny_engine.context_length} tokens" in message
    assert f"{n_prompt} in the prompt" in message


def test_load_engine_builds_any_engine_and_refuses_nonsense(tiny_model_dir):
    engine = load_engine("04_engine:BaselineEngine", str(tiny_model_dir), device="cpu")
    assert isinstance(engine, engine_mod.BaselineEngine)
    for spec in ("04_engine", "no_such_module:Engine", "04_engine:NoSuchClass", "04_engine:SamplingParams"):
        with pytest.raises(ValueError):
            load_engine(spec, str(tiny_model_dir), device="cpu")


def test_a_spec_carries_flags_of_its_own_and_they_win_for_that_engine(tiny_model_dir):
    """`--engine "module:Class --flag value"`: the command line's engine flags, read the same way, for
    that engine alone (a benchmark compares int8 with int4 so); a bad one is a ValueError naming the spec."""
    from kit import engines

    assert engines.split_spec("16_quantization_engine:QuantizedEngine --quant int4 --group-size 64") == \
        ("16_quantization_engine:QuantizedEngine", {"quant": "int4", "group_size": 64})
    assert engines.split_spec("minivllm:LLM") == ("minivllm:LLM", {})
    engine = load_engine("16_quantization_engine:QuantizedEngine --quant int4", str(tiny_model_dir),
                         device="cpu", quant="int8", max_num_seqs=3)   # the shared flags
    assert engine.quant.startswith("int4") and engine.max_num_seqs == 3
    for bad in ("04_engine:BaselineEngine --quant int3", "04_engine:BaselineEngine --no-such-flag",
                "04_engine:BaselineEngine --quant", '04_engine:BaselineEngine "', "  "):
        with pytest.raises(ValueError, match="engine spec"):
            load_engine(bad, str(tiny_model_dir), device="cpu")
    with pytest.raises(ValueError, match="04_engine:BaselineEngine does not take quant"):
        load_engine("04_engine:BaselineEngine --quant int4", str(tiny_model_dir), device="cpu")


def test_every_engine_states_what_it_can_do_in_one_record(tiny_model_dir):
    """capabilities(): the contract alone by default, and each chapter's engine says what it adds."""
    from minivllm.contracts import EngineCapabilities

    assert BaseOfflineEngine.capabilities(None) == EngineCapabilities()
    assert not any([EngineCapabilities().streams, EngineCapabilities().schedules_itself])
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        EngineCapabilities(max_batch_size=0)
    with pytest.raises(TypeError):
        EngineCapabilities().replace(submits=True)
    folder = str(tiny_model_dir)
    added = [(load_engine("04_engine:BaselineEngine", folder, device="cpu"),
              dict(streams=True, checks_prompts=True, max_batch_size=None, schedules_itself=False)),
             (load_script("09_static_batching").StaticBatchEngine(folder, device="cpu", max_batch_size=5),
              dict(streams=True, checks_prompts=True, max_batch_size=5, schedules_itself=False)),
             (load_engine("10_model_engine:ModelEngine --max-num-seqs 3", folder, device="cpu"),
              dict(streams=True, checks_prompts=False, max_batch_size=3, schedules_itself=False)),
             (load_engine("minivllm:LLM --max-num-seqs 4 --kv-memory 1MB", folder, device="cpu"),
              dict(streams=True, max_batch_size=None, schedules_itself=True, max_num_seqs=4))]
    for engine, fields in added:
        try:
            can = engine.capabilities()
            assert {name: getattr(can, name) for name in fields} == fields, type(engine)
            assert can.accepts_token_ids and can.context_length == engine.context_length, type(engine)
            assert can.model_name == folder and can.device == "cpu", type(engine)
            assert (can.token_capacity is not None) == can.schedules_itself, type(engine)
        finally:
            engine.close()


def test_tokenize_checks_a_prompt_and_takes_token_ids_as_they_are(tiny_engine):
    """The one check every engine makes: text is tokenised, a list of ids (the server tokenises once)
    must name tokens of the vocabulary; either way the budget must fit the context."""
    tok, vocab = tiny_engine.tokenizer, tiny_engine.vocab_size
    ids = tokenize(tok, "Hello there", 4, 512)
    assert ids == tok("Hello there").input_ids
    assert tokenize(tok, ids, 4, 512, vocab) == ids
    assert tokenize(tok, ids, 512 - len(ids), 512, vocab) == ids          # exactly the context
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        tokenize(tok, ids, 513 - len(ids), 512, vocab)
    for bad in ([], [-1], [vocab], [1.5], [True], [1, "2"]):
        with pytest.raises(ValueError, match="prompt token ids"):
            tokenize(tok, bad, 4, 512, vocab)
    with pytest.raises(ValueError, match="prompt token ids"):
        tokenize(tok, ids, 4, 512)                 # no vocabulary size: ids cannot be checked
    for prompt, n, match in (("", 4, "non-empty string"), (None, 4, "non-empty string"), ("Hi", 0, "max_new_tokens")):
        with pytest.raises(ValueError, match=match):
            tokenize(tok, prompt, n, 512, vocab)


def test_render_chat_uses_the_template_for_the_whole_conversation(tiny_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    text = render_chat(tiny_engine.tokenizer, messages)
    assert all(m["content"] in text for m in messages)
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ the real model
# Recorded once from SmolLM2-135M-Instruct (float32, CPU): greedy continuations.
GOLDEN = {
    "The capital of France is": [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33,
                                 29, 34, 34, 216, 33, 34, 42, 33],
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n":
        [504, 3575, 282, 4649, 314, 7042, 30, 2],
}


@pytest.mark.real_model
def test_golden_greedy_continuations(real_engine):
    for prompt, expected in GOLDEN.items():
        result = real_engine.generate(prompt, 24)
        assert result.output_ids == expected
    chat = real_engine.generate(list(GOLDEN)[1], 24)
    assert chat.text == "The capital of France is Paris." and chat.finish_reason == "stop"


@pytest.mark.real_model
def test_real_model_runs_on_cpu_in_float32(real_engine):
    assert real_engine.device.type == "cpu"
    assert next(real_engine.model.parameters()).dtype == torch.float32
    assert real_engine.context_length == 8192


def test_demo_flags_reach_the_engine_including_dtype(tiny_model_dir, capsys):
    import torch

    args = demo_parser("test").parse_args(
        ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "bfloat16", "--max-new-tokens", "2"])
    engine, _, _ = demo(engine_mod.BaselineEngine, args)
    assert engine.model.dtype == torch.bfloat16 and "[Output]" in capsys.readouterr().out
    assert demo_parser("test").parse_args([]).dtype == "auto"   # bfloat16 on a GPU, float32 here


def test_threads_flag_sets_torch_threads_and_refuses_zero():
    import argparse

    import torch

    from kit import cli

    parser = argparse.ArgumentParser()
    cli.add_model_flags(parser, threads=True)
    saved = torch.get_num_threads()
    try:
        assert parser.parse_args(["--threads", "1"]).threads == 1 and torch.get_num_threads() == 1
        assert parser.parse_args([]).threads is None
        with pytest.raises(SystemExit):
            parser.parse_args(["--threads", "0"])
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("spec", ["04_engine:BaselineEngine", "07_decode_loop:DecodeLoopEngine",
                                  "09_static_batching:StaticBatchEngine", "10_model_engine:ModelEngine",
                                  "11_paged_kv_engine:PagedEngine", "12_prefix_cache_engine:PrefixCachingEngine",
                                  "minivllm:LLM", "16_quantization_engine:QuantizedEngine --quant int8"])
def test_every_engine_refuses_bad_arguments_with_value_error(spec, tiny_model_dir):
    """The same refusals through every chapter's engine, single and batch: never a TypeError from
    deep inside, never a silent default, never a request without an end (NaN fails every comparison)."""
    engine = load_engine(spec, str(tiny_model_dir), device="cpu")
    try:
        # LLM's budget may come from SamplingParams.max_tokens instead: None is its default there
        optional = inspect.signature(engine.generate).parameters["max_new_tokens"].default is None
        for max_new_tokens in (float("nan"), 1.5, 2.0, True) + (() if optional else (None,)):
            with pytest.raises(ValueError, match="max_new_tokens"):
                engine.generate("Hello", max_new_tokens)
            with pytest.raises(ValueError, match="max_new_tokens"):
                engine.generate_batch(["Hello", "Hi"], max_new_tokens)
        for params in ({"temperature": 0.5}, "greedy", 0, SamplingParams):
            with pytest.raises(ValueError, match="params"):
                engine.generate("Hello", 2, params)
            with pytest.raises(ValueError, match="params"):
                engine.generate_batch(["Hello"], 2, params)
        assert engine.generate("Hello", 2, None).output_ids == engine.generate("Hello", 2, SamplingParams()).output_ids
    finally:
        engine.close()


def test_metrics_print_with_their_units_and_an_unknown_one_is_refused():
    metrics = RequestMetrics(throughput=3.24, input_tokens=12, output_tokens=40, ttft_ms=81.0)
    assert metric_lines(metrics) == ["  throughput      3.2 tokens/s", "  input_tokens    12 tokens",
                                     "  output_tokens   40 tokens", "  ttft_ms         81.0 ms"]

    class Odd:
        def as_dict(self):
            return {"speed": 1.0}
    with pytest.raises(ValueError, match="'speed' has no unit"):
        metric_lines(Odd())


def test_a_streamed_answer_prints_as_strip_would_and_returns_the_result(capsys):
    result = object()
    assert print_streamed(["  ", "Hello", " ", "world.\nNext", " line ", "\n", result]) is result
    assert capsys.readouterr().out == "  Hello world.\n  Next line\n"


def test_an_engine_script_runs_with_its_features_and_dtype(tiny_model_dir):
    """engine_main: the demo's --dtype and the engine's feature flags reach the engine once each."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    done = subprocess.run([sys.executable, "13_continuous_batching_engine.py", "--model", str(tiny_model_dir),
                           "--device", "cpu", "--dtype", "bfloat16", "--max-new-tokens", "3", "--prefix-caching"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[Metrics]" in done.stdout and "'prefix_caching': True" in done.stdout


def test_the_demos_seed_is_the_requests_not_a_keyword_for_an_engine_without_one(monkeypatch):
    """`python 04_engine.py --seed 1`: BaselineEngine takes no seed, so none is passed to it."""
    import sys

    from kit import demo as kit_demo

    class Engine:
        def __init__(self, model_name=None, device=None, dtype=None):
            pass

    seen = {}
    monkeypatch.setattr(kit_demo, "demo", lambda cls, args, **features: seen.update(features, request_seed=args.seed))
    monkeypatch.setattr(sys, "argv", ["04_engine.py", "--seed", "1", "--temperature", "0.8"])
    kit_demo.engine_main(Engine, "a demo")
    assert seen == {"request_seed": 1}
