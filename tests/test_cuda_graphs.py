"""Chapter 15: decode steps through CUDA graphs' static buffers, checked on the CPU.

There is no graph to replay here; the runner takes the same path without it (pad to a bucket,
fill the static buffers, run the model on them), so these tests check everything but the replay:
the bucket table, what the buffers hold, that padding rows write only the scratch block, that
the paged kernel (under Triton's interpreter) computes the step the CPU path computes, and that
the engine's greedy tokens are the same with the path as without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # the paged kernel, if a test runs it, on the CPU

import dataclasses

import pytest
import torch

from minivllm import LLM
from minivllm.config import EngineConfig
from minivllm.contracts import SamplingParams
from minivllm.cuda_graphs import CUDAGraphRunner, bucket_for, buckets
from minivllm.kv_cache import KVPool
from minivllm.llm import decode_graphs
from minivllm.model_runner import ModelRunner, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 4   # tokens per block in the runner tests: small, so that rows span several blocks


class Tokens:
    """All a runner's forward reads of a request: its token ids."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def tokens(self, start: int, n: int) -> list[int]:
        return self.ids[start:start + n]


def test_buckets():
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(8) == [1, 2, 4, 8] and buckets(5) == [1, 2, 4, 5] and buckets(1) == [1]
    assert [bucket_for(n, buckets(32)) for n in (1, 3, 5, 8, 9, 17, 25, 32)] == [1, 4, 8, 8, 16, 24, 32, 32]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def runners(model):
    """A plain runner and a graph runner (max 8 rows, 32 tokens a row) on two equal pools of 12 blocks."""
    pools = [KVPool(model.config, 12, BS) for _ in range(2)]
    return ModelRunner(model, pools[0]), CUDAGraphRunner(model, pools[1], max_num_seqs=8, max_model_len=32)


# Three sequences: their block tables (shuffled, ragged) and the prompts they prefill.
TABLES = [[5, 2], [7], [0, 9, 3]]
PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38, 39]]


def prefill_then_decode(runner):
    """Prefill the three prompts (an eager step on either runner), then one decode step of a new
    token each: returns the decode's logits."""
    seqs = [Tokens(p + [100 + i]) for i, p in enumerate(PROMPTS)]
    runner.forward(seqs, [0, 0, 0], [len(p) for p in PROMPTS], TABLES)
    return runner.forward(seqs, [len(p) for p in PROMPTS], [1, 1, 1], TABLES)


def test_static_buffers_hold_the_step_padded_to_its_bucket(model):
    _, graphs = runners(model)
    seqs = [Tokens(p + [100 + i]) for i, p in enumerate(PROMPTS)]
    assert graphs.fill(seqs, [5, 2, 9], TABLES) == 4                  # 3 rows: the bucket of 4
    s, scratch = graphs.static, 11                                   # the pool's last block
    assert s.token_ids[:4].tolist() == [100, 101, 102, 0]
    assert s.positions[:4].tolist() == [5, 2, 9, 0]
    # position 5 is offset 1 of table[1] = block 2; 2 is offset 2 of block 7; 9 offset 1 of block 3
    assert s.slots[:4].tolist() == [2 * BS + 1, 7 * BS + 2, 3 * BS + 1, scratch * BS]
    assert s.context_lens[:4].tolist() == [6, 3, 10, 1]
    assert s.block_tables.shape == (8, 8)                            # 32 tokens / 4: one width for all
    assert s.block_tables[:4].tolist() == [[5, 2] + [scratch] * 6, [7] + [scratch] * 7,
                                           [0, 9, 3] + [scratch] * 5, [scratch] * 8]


def test_padding_rows_write_only_the_scratch_block(model):
    plain, graphs = runners(model)
    expected, logits = prefill_then_decode(plain), prefill_then_decode(graphs)
    assert logits.shape == expected.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    scratch = slice(11 * BS, 12 * BS)
    for layer in range(model.config.num_layers):
        for mine, theirs in ((graphs.kv.k[layer], plain.kv.k[layer]), (graphs.kv.v[layer], plain.kv.v[layer])):
            torch.testing.assert_close(mine[:scratch.start], theirs[:scratch.start], atol=1e-5, rtol=1e-5)
            assert theirs[scratch].abs().sum() == 0                  # the plain runner never touches it
            assert mine[scratch.start].abs().sum() > 0               # the padding row's key went there
            assert mine[scratch.start + 1:].abs().sum() == 0         # and only there


def test_the_paged_kernel_computes_the_cpu_paths_step(model):
    """The GPU's attention (the Triton kernel, interpreted) inside the model's forward, on the
    static buffers of a padded step, against the CPU path's gather + SDPA on the same buffers."""
    pytest.importorskip("triton")
    _, graphs = runners(model)
    seqs = [Tokens(p + [100 + i]) for i, p in enumerate(PROMPTS)]
    graphs.forward(seqs, [0, 0, 0], [len(p) for p in PROMPTS], TABLES)          # the prefill
    size = graphs.fill(seqs, [len(p) for p in PROMPTS], TABLES)
    pool_before = [k.clone() for k in graphs.kv.k]
    on_cpu = model.forward(graphs.batches[size], graphs.kv, all_logits=True)
    for k, before in zip(graphs.kv.k, pool_before):                 # the step wrote its keys; again is the same
        k.copy_(before)
    in_place = dataclasses.replace(graphs.batches[size], in_place=True)
    torch.testing.assert_close(model.forward(in_place, graphs.kv, all_logits=True), on_cpu, atol=1e-5, rtol=1e-5)


def test_every_bucket_writes_one_logits_buffer(model):
    """One float32 buffer of [largest bucket, vocab], as nano-vllm's: each step's logits are its
    first rows, and the runner hands back a copy (the next step writes the same memory)."""
    _, graphs = runners(model)
    assert graphs.logits.shape == (8, model.config.vocab_size) and not hasattr(graphs, "outputs")
    seqs = [Tokens(p + [100 + i]) for i, p in enumerate(PROMPTS)]
    graphs.forward(seqs, [0, 0, 0], [len(p) for p in PROMPTS], TABLES)          # the prefill, eager
    address = graphs.logits.data_ptr()
    for n in (1, 3):                                                              # buckets 1 and 4
        out = graphs.forward(seqs[:n], [len(p) for p in PROMPTS[:n]], [1] * n, TABLES[:n])
        assert torch.equal(out, graphs.logits[:n]) and out.data_ptr() != address
    assert graphs.logits.data_ptr() == address


def test_block_tables_are_written_by_delta(model):
    """A step writes only the block-table entries that changed: a running row's new block, or every
    entry of a row whose table is another's. The buffers then hold what a full rebuild would."""
    _, graphs = runners(model)
    tables = [[5, 2], [7], [0, 9, 3]]
    seqs = [Tokens(list(range(12))) for _ in tables]
    written = []
    real = graphs.write_tables

    def spy(places, size):
        before = graphs.static.block_tables.clone()
        real(places, size)
        written.append(int((graphs.static.block_tables != before).sum()))
    graphs.write_tables = spy
    graphs.fill(seqs, [5, 2, 9], tables)
    tables[1].append(4)                                              # row 1 crosses into a new block
    graphs.fill(seqs, [6, 4, 10], tables)
    assert written == [6, 1]                                         # all of them, then just the new one
    swapped = [tables[2], tables[0]]                                 # rows now hold other tables
    graphs.fill(seqs[:2], [10, 6], swapped)
    assert graphs.static.block_tables[:2, :3].tolist() == [[0, 9, 3], [5, 2, 11]]
    assert graphs.static.context_lens[:2].tolist() == [11, 7] and graphs.held[1][0] is tables[0]


def test_a_requests_tokens_are_sliced_without_copying_the_sequence():
    from minivllm.output import Request
    r = Request(0, [1, 2, 3, 4], None, 8, None)
    r.new_ids, r.draft_ids = [5, 6], [7]
    whole = [1, 2, 3, 4, 5, 6, 7]
    assert all(r.tokens(s, n) == whole[s:s + n] for s in range(8) for n in range(9))
    prefix = r.first_tokens(6)
    assert len(prefix) == 6 and prefix[0:4] == [1, 2, 3, 4] and prefix[4:8] == [5, 6] and tuple(prefix[2:5]) == (3, 4, 5)


def test_other_steps_run_eagerly(model):
    """Prefills, mixed steps, verifications and batches past the largest bucket leave the buffers alone."""
    _, graphs = runners(model)
    seqs = [Tokens(p + [100 + i]) for i, p in enumerate(PROMPTS)]
    graphs.forward(seqs, [0, 0, 0], [len(p) for p in PROMPTS], TABLES)
    graphs.forward(seqs[:2], [5, 0], [1, 2], TABLES[:2])                         # mixed
    graphs.forward(seqs[:1], [4], [2], TABLES[:1], num_logits=[2])               # a verification
    assert graphs.static.context_lens.tolist() == [1] * 8                        # untouched


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_tokens_are_the_same_with_the_graph_path(tiny_model_dir, prefix_caching, monkeypatch):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4, 5,", "Hello",
               "Write a haiku about the sea, in the style of a pirate who lost his ship"]
    prompts += prompts[:2]                    # 7 rows: every decode step pads one row to the bucket of 8
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(device="cpu", kv_memory=1 << 20, block_size=8, max_num_seqs=8, prefix_caching=prefix_caching)
    with LLM(str(tiny_model_dir), **options) as plain:
        assert type(plain.runner) is ModelRunner                     # on the CPU, eager by default
        expected = [r.output_ids for r in plain.generate_batch(prompts, params=params)]
    steps = []
    fill = CUDAGraphRunner.fill
    monkeypatch.setattr(CUDAGraphRunner, "fill", lambda self, *a: steps.append(fill(self, *a)) or steps[-1])
    with LLM(str(tiny_model_dir), enforce_eager=False, **options) as graphs:
        assert graphs.blocks.num_blocks == graphs.pool.num_blocks - 1     # the scratch block is never handed out
        got = [r.output_ids for r in graphs.generate_batch(prompts, params=params)]
    assert got == expected
    assert steps.count(8) >= 11, steps                              # the decode steps took the padded path


def test_enforce_eager_and_the_defaults():
    config = EngineConfig()
    assert decode_graphs(config, torch.device("cuda"), 512).max_num_seqs == 32     # graphs on CUDA by default
    assert decode_graphs(config, torch.device("cpu"), 512) is None                 # eager elsewhere
    assert decode_graphs(EngineConfig(enforce_eager=False), torch.device("cpu"), 512) is not None
    assert decode_graphs(EngineConfig(enforce_eager=True), torch.device("cuda"), 512) is None
    assert decode_graphs(EngineConfig(compile=True), torch.device("cuda"), 512) is None
    assert decode_graphs(EngineConfig(speculative="ngram"), torch.device("cuda"), 512) is None
    with pytest.raises(ValueError, match="enforce_eager=False .* does not combine with compile"):
        EngineConfig(compile=True, enforce_eager=False)
    with pytest.raises(ValueError, match="enforce_eager must be True, False or None"):
        EngineConfig(enforce_eager="yes")


def test_hf_with_a_static_cache_is_the_same_model_as_hf(tiny_model_dir):
    """19_gpu.StaticCacheEngine, the GPU peer (HF generate with cache_implementation="static"),
    gives Chapter 1's greedy tokens, one prompt and a padded batch: only the cache changed."""
    from conftest import load_script
    gpu19, engine04 = load_script("19_gpu"), load_script("04_engine")
    plain = engine04.BaselineEngine(str(tiny_model_dir), device="cpu")
    static = gpu19.StaticCacheEngine(str(tiny_model_dir), device="cpu")
    prompts, endless = ["Hello, how are you?", "The sky is blue because the light"], SamplingParams(ignore_eos=True)
    assert static._generation_config(endless, 8).cache_implementation == "static"
    for p in prompts:
        assert static.generate(p, 8, endless).output_ids == plain.generate(p, 8, endless).output_ids
    assert [r.output_ids for r in static.generate_batch(prompts, 8, endless)] == \
        [r.output_ids for r in plain.generate_batch(prompts, 8, endless)]


def test_the_gpu_check_runs_as_a_dry_run_on_the_cpu(tiny_model_dir, capsys, monkeypatch):
    """`python 19_gpu.py --check` on the CPU: the kernel interpreted against gather + SDPA, graphs'
    path against eager, int8/int4/w8a8, then the speed table beside HF with a static cache (a dry
    run: its figures are not read here). Its six engines share one tokenizer load, for time."""
    import functools

    from conftest import load_script
    from minivllm import llm
    monkeypatch.setattr(llm, "load_tokenizer", functools.cache(llm.load_tokenizer))
    gpu19 = load_script("19_gpu")
    assert gpu19.run_checks(tiny_model_dir, torch.device("cpu"), str(tiny_model_dir))
    out = capsys.readouterr().out
    assert out.count("  ok  ") == 5 and "FAIL" not in out
    assert "[speed]" in out and all(w in out for w in ("batch 1 ", "batch 4 ", "mixed 4 "))
