"""Chapter 16: many answers from one prompt. Fork and copy-on-write in the block manager, n and
best_of through the engine, seeded choices that ignore their batch mates."""

from __future__ import annotations

import dataclasses
import time

import pytest

from minivllm import LLM
from minivllm.block_manager import BlockManager
from minivllm.contracts import SamplingParams
from minivllm.prefix_cache import PrefixCachingBlockManager

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4      # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
PROMPT = "The sea, the sea, the sea, and the ships on it are"


@pytest.mark.parametrize("manager", [BlockManager, PrefixCachingBlockManager])
def test_fork_shares_every_block_and_the_first_write_copies_the_partial_one(manager):
    bm = manager(16, 4)
    bm.allocate_prompt(0, list(range(10)))          # blocks for 10 tokens: 4 + 4 + 2
    table = list(bm.tables[0])
    bm.fork(0, 1), bm.fork(0, 2)
    assert bm.tables[1] == bm.tables[2] == table and [bm.ref_counts[b] for b in table] == [3, 3, 3]
    assert bm.num_free == 13
    bm.own(1, 9, 10)                                # writes token 9 into the shared, partly filled block
    assert bm.tables[1][:2] == table[:2] and bm.tables[1][2] != table[2]
    assert bm.take_copies() == [(table[2], bm.tables[1][2])] and bm.take_copies() == []
    bm.own(2, 9, 10)
    bm.own(0, 9, 10)                                # the last owner writes in place: no copy
    assert bm.tables[0][2] == table[2] and len(bm.take_copies()) == 1
    assert [bm.ref_counts[b] for b in table] == [3, 3, 1]
    for seq in (1, 0):
        bm.free(seq)
    assert [bm.ref_counts[b] for b in table[:2]] == [1, 1]
    bm.free(2)
    assert bm.num_free == 16


def engine(tiny_model_dir, **extra):
    return LLM(str(tiny_model_dir), device="cpu", kv_memory=4096 * TINY_KV_BYTES_PER_TOKEN, block_size=8,
               max_num_seqs=8, **extra)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_answers_fork_one_prefill_and_seeded_choices_ignore_batch_mates(tiny_model_dir, prefix_caching):
    """Choice 0 of n = 4 is the n = 1 answer; the four answers differ, and are the same alone and
    among other requests; greedy n = 3 gives three equal answers; the pool is whole after."""
    llm = engine(tiny_model_dir, prefix_caching=prefix_caching)
    try:
        four = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
        one = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))
        alone = llm.generate(PROMPT, four)
        assert len(alone.outputs) == 4 and [o.index for o in alone.outputs] == [0, 1, 2, 3]
        assert alone.outputs[0].token_ids == one.output_ids and alone.text == alone.outputs[0].text
        assert len({tuple(o.token_ids) for o in alone.outputs}) == 4
        assert alone.metrics.output_tokens == 4 * 12
        others = [SamplingParams(temperature=0.8, seed=s, max_tokens=10, ignore_eos=True) for s in range(3)]
        mixed = llm.generate(["Hello there", PROMPT, "One two three", "Why?"], [others[0], four, *others[1:]])
        assert [o.token_ids for o in mixed[1].outputs] == [o.token_ids for o in alone.outputs]
        greedy = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8))
        assert len({tuple(o.output_ids) for o in greedy.outputs}) == 1
        assert greedy.outputs[0].token_ids == llm.generate(PROMPT, SamplingParams(max_tokens=8)).output_ids
        assert not llm.blocks.tables and not llm.scheduler.has_work()
        held = llm.blocks.num_blocks - llm.blocks.num_free
        assert held == 0 or prefix_caching          # (a prefix cache keeps its blocks, evictable)
    finally:
        llm.close()


def test_best_of_keeps_the_likeliest_and_bad_n_is_refused(tiny_model_dir):
    llm = engine(tiny_model_dir)
    try:
        params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
        got = llm.generate(PROMPT, params)
        everyone = llm.generate(PROMPT, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                       logprobs=0))
        means = sorted((o.cumulative_logprob / len(o.token_ids), o.token_ids) for o in everyone.outputs)[::-1]
        assert [o.token_ids for o in got.outputs] == [ids for _, ids in means[:2]]
        assert got.outputs[0].logprobs is None and got.metrics.output_tokens == 5 * 8
        with pytest.raises(ValueError, match="max_num_seqs"):
            llm.generate(PROMPT, SamplingParams(n=9))
        with pytest.raises(ValueError, match="best_of"):
            SamplingParams(n=3, best_of=2)
        with pytest.raises(ValueError, match="best_of"):
            SamplingParams(best_of=21)
    finally:
        llm.close()


def test_preemption_and_abort_free_every_answer(tiny_model_dir):
    """A pool too small for all six answers at once: they are preempted and recomputed, each
    on its own, and still give the answers a roomy pool gives; an abort frees all of them."""
    params = SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    roomy = engine(tiny_model_dir)
    try:
        expected = [o.token_ids for o in roomy.generate(PROMPT, params).outputs]
        stream = roomy.submit(PROMPT, 400, dataclasses.replace(params, max_tokens=400))
        next(iter(stream))
        stream.close()
        for _ in range(500):
            if not roomy.scheduler.has_work():
                break
            time.sleep(0.01)
        assert not roomy.blocks.tables and roomy.blocks.num_free == roomy.blocks.num_blocks
    finally:
        roomy.close()
    tight = LLM(str(tiny_model_dir), device="cpu", kv_memory=48 * TINY_KV_BYTES_PER_TOKEN, block_size=4, max_num_seqs=8)
    try:
        got = tight.generate(PROMPT, params)
        assert tight.scheduler.num_preemptions > 0
        assert [o.token_ids for o in got.outputs] == expected
    finally:
        tight.close()


def test_the_server_answers_n_choices_streamed_or_not_as_the_library_does(tiny_model_dir):
    """n = 4 seeded: the same four answers through /v1/completions as through the library, alone or
    beside another request; streamed chunks carry each choice's index; usage counts the prompt once
    and every completion token; best_of with stream, and best_of < n, are 400s."""
    import json

    from fastapi.testclient import TestClient

    from tests.conftest import load_script
    server = load_script("05_server")
    llm = engine(tiny_model_dir)
    try:
        params = SamplingParams(n=4, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
        expected = [o.text for o in llm.generate(PROMPT, params).outputs]
        body = {"prompt": PROMPT, "n": 4, "temperature": 1.0, "seed": 21, "max_tokens": 6, "ignore_eos": True}
        with TestClient(server.make_app(llm)) as client:
            plain = client.post("/v1/completions", json=body).json()
            assert [c["text"] for c in plain["choices"]] == expected and [c["index"] for c in plain["choices"]] == [0, 1, 2, 3]
            assert plain["usage"]["completion_tokens"] == 24 and plain["usage"]["prompt_tokens"] == len(
                llm.tokenizer(PROMPT).input_ids)
            two = client.post("/v1/completions", json={**body, "prompt": [PROMPT, "Hello there"]}).json()
            assert [c["text"] for c in two["choices"][:4]] == expected and len(two["choices"]) == 8
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: {")]
            texts = ["", "", "", ""]
            for event in events:
                for choice in event["choices"]:
                    texts[choice["index"]] += choice["text"]
            assert texts == expected
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                             "n": 3, "max_tokens": 4}).json()
            assert len(chat["choices"]) == 3 and len({c["message"]["content"] for c in chat["choices"]}) == 1
            for bad in ({"best_of": 2, "stream": True}, {"best_of": 2}, {"n": 9}):
                r = client.post("/v1/completions", json={**body, **bad})
                assert r.status_code == 400, r.text
    finally:
        llm.close()


def test_beam_search_top_beam_is_hfs_with_eos_ignored_and_with_eos_and_a_length_penalty(tiny_model_dir, tmp_path):
    """HF's generate(num_beams=4, do_sample=False) in float32, token for token: EOS ignored, and EOS on
    with length_penalty 0.6 (a frequent token made the EOS, so that beams do finish early)."""
    import json
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    from minivllm import BeamSearchParams
    folder = tmp_path / "tiny-eos"
    shutil.copytree(tiny_model_dir, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = 37328                  # the third token of this prompt's best beams
        (folder / name).write_text(json.dumps(config))
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cpu", kv_memory=4096 * TINY_KV_BYTES_PER_TOKEN, block_size=8,
              prefix_caching=True)
    try:
        for prompt in ("The capital of France is",):
            ids = llm.new_request(prompt, 8).prompt_ids
            for ignore_eos, penalty in ((True, 1.0), (False, 0.6)):
                got = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=ignore_eos,
                                                                 length_penalty=penalty))[0].sequences
                hf.generation_config.eos_token_id = None if ignore_eos else sorted(llm.output.eos_token_ids)
                ref = hf.generate(torch.tensor([ids]), num_beams=4, do_sample=False, max_new_tokens=10,
                                  length_penalty=penalty, pad_token_id=0)[0, len(ids):].tolist()
                while ref and ref[-1] == 0 and not ignore_eos:
                    ref.pop()                           # HF pads a finished beam
                assert got[0].output_ids == ref, (prompt, ignore_eos)
                assert len(got) == 4 and got[0].score >= got[-1].score
                assert ("stop" in {s.finish_reason for s in got}) != ignore_eos   # EOS on: some beams finished
        assert not llm.blocks.tables
    finally:
        llm.close()
