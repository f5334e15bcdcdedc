"""Chapter 7: the paged KV cache. Same logits as the contiguous cache, same tokens as the
baseline, and a block manager that never loses, leaks or double-books a block."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import load_script, step_by_step_logits
from kit.engines import load_engine
from kit.workloads import load_workload
from minivllm.block_manager import BlockManager
from minivllm.contracts import SamplingParams
from minivllm.kv_cache import KVPool, PagedBatch, PoolFullError
from minivllm.model import LlamaModel

engine10 = load_script("10_model_engine")
paged = load_script("11_paged_kv")
engine11 = load_script("11_paged_kv_engine")
demo = load_script("11_paged_kv_demo")

IDS = list(range(5, 208, 7))          # 29 tokens: 20 prefilled, then 9 decode steps
N_PROMPT = 20


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return LlamaModel.from_folder(tiny_model_dir)


def paged_logits(model, pool, blocks, seq_id: int, ids: list[int], n_prompt: int, between=None) -> torch.Tensor:
    """The same through the pool; `between()` runs before every decode step (other sequences' traffic)."""
    bs = pool.block_size
    table = blocks.allocate(seq_id, n_prompt)
    out = [model.forward(PagedBatch.from_tables([ids[:n_prompt]], [table], [0], bs), pool, all_logits=True)]
    for t in range(n_prompt, len(ids)):
        if between:
            between()
        blocks.append_slot(seq_id)
        batch = PagedBatch.from_tables([[ids[t]]], [blocks.tables[seq_id]], [t], bs)
        out.append(model.forward(batch, pool))
    return torch.cat(out)


def new_pool(model, num_blocks: int, block_size: int):
    return KVPool(model.config, num_blocks, block_size), BlockManager(num_blocks, block_size)


@pytest.mark.parametrize("block_size", [1, 4, 7, 16])   # 7 and 16 do not divide the 20-token prompt
def test_paged_logits_equal_contiguous(tiny_model, block_size):
    pool, blocks = new_pool(tiny_model, 64, block_size)
    got = paged_logits(tiny_model, pool, blocks, 0, IDS, N_PROMPT)
    want = step_by_step_logits(tiny_model, IDS, N_PROMPT)
    assert got.shape == want.shape == (len(IDS), tiny_model.config.vocab_size)
    # A lone sequence in a fresh pool has consecutive blocks: context() reads them as a view.
    assert PagedBatch.from_tables([[1]], [blocks.tables[0]], [len(IDS) - 1], block_size).first_of_run == 0
    assert (got - want).abs().max().item() <= 1e-5


def test_scattered_blocks_give_exact_results(tiny_model):
    """Fill the pool with one-block sequences, free them in a shuffled order, and let other
    sequences keep taking blocks between decode steps: the table ends up out of order."""
    pool, blocks = new_pool(tiny_model, 48, 4)
    rng = random.Random(3)
    for s in range(48):
        blocks.allocate(100 + s, 4)
    for s in rng.sample(range(48), 48):
        blocks.free(100 + s)
    others = iter(range(200, 300))
    got = paged_logits(tiny_model, pool, blocks, 0, IDS, N_PROMPT, between=lambda: blocks.allocate(next(others), 3))
    table = blocks.tables[0]
    assert len(table) == 8
    assert table != sorted(table) and any(b - a != 1 for a, b in zip(table, table[1:]))
    assert PagedBatch.from_tables([[1]], [table], [len(IDS) - 1], 4).first_of_run is None   # copied
    assert (got - step_by_step_logits(tiny_model, IDS, N_PROMPT)).abs().max().item() <= 1e-5


def test_ragged_paged_batch_equals_each_sequence_alone(tiny_model):
    a, b, c = list(range(10, 40)), list(range(50, 57)), list(range(70, 71))
    alone = [step_by_step_logits(tiny_model, s, len(s))[-1] for s in (a, b, c)]
    pool, blocks = new_pool(tiny_model, 32, 4)
    blocks.allocate(7, 1)                            # one block taken first, so nobody starts at 0
    ta = blocks.allocate(0, 12)
    tb = blocks.allocate(1, len(b) - 1)
    tiny_model.forward(PagedBatch.from_tables([a[:12]], [ta], [0], 4), pool)
    tiny_model.forward(PagedBatch.from_tables([b[:-1]], [tb], [0], 4), pool)
    # One forward: a finishes its prefill (18 tokens), b decodes, c is a fresh one-token prompt.
    for _ in a[12:]:
        blocks.append_slot(0)
    blocks.append_slot(1)
    tc = blocks.allocate(2, 1)
    batch = PagedBatch.from_tables([a[12:], b[-1:], c], [blocks.tables[0], blocks.tables[1], tc],
                                   [12, len(b) - 1, 0], 4)
    mixed = tiny_model.forward(batch, pool)
    for got, want in zip(mixed, alone):
        assert (got - want).abs().max().item() <= 1e-5


def test_batch_refuses_tokens_beyond_its_blocks(tiny_model):
    with pytest.raises(ValueError, match="run past the blocks"):
        PagedBatch.from_tables([[1, 2, 3, 4, 5]], [[0]], [0], 4)
    with pytest.raises(ValueError, match="at least one new token"):
        PagedBatch.from_tables([[]], [[0]], [0], 4)


# ---------------------------------------------------------------- the block manager
def check_books(blocks: BlockManager) -> None:
    """Every block is either free (count 0, once in the free list) or held (count = holders)."""
    held = [b for table in blocks.tables.values() for b in table]
    free = list(blocks.free_blocks)
    assert len(free) == len(set(free)) == blocks.num_free
    for b in range(blocks.num_blocks):
        assert blocks.ref_counts[b] == held.count(b)
        assert (b in free) == (blocks.ref_counts[b] == 0)
    for seq, table in blocks.tables.items():
        assert len(table) == blocks.blocks_for(blocks.lengths[seq])


def snapshot(blocks: BlockManager):
    return (list(blocks.free_blocks), list(blocks.ref_counts),
            {s: list(t) for s, t in blocks.tables.items()}, dict(blocks.lengths))


def test_random_operations_return_every_block():
    blocks = BlockManager(num_blocks=40, block_size=4)
    rng, next_id, refused = random.Random(0), 0, 0
    for step in range(1000):
        live = list(blocks.tables)
        op = rng.choice(["allocate", "append", "append", "free"] if live else ["allocate"])
        if op == "allocate":
            n = rng.randint(1, 24)
            if blocks.can_allocate(n):
                assert len(blocks.allocate(next_id, n)) == blocks.blocks_for(n)
                next_id += 1
            else:
                before = snapshot(blocks)
                with pytest.raises(PoolFullError):
                    blocks.allocate(next_id, n)
                assert snapshot(blocks) == before
                refused += 1
        elif op == "append":
            seq = rng.choice(live)
            before = snapshot(blocks)
            try:
                slot = blocks.append_slot(seq)
            except PoolFullError:
                assert snapshot(blocks) == before and blocks.num_free == 0
                refused += 1
            else:
                n = blocks.lengths[seq] - 1      # the token that slot is for
                assert slot == blocks.tables[seq][n // 4] * 4 + n % 4
        else:
            blocks.free(rng.choice(live))
        if step % 50 == 0:
            check_books(blocks)
    assert refused > 0 and next_id > 100         # the pool really did fill up, many times
    for seq in list(blocks.tables):
        blocks.free(seq)
    check_books(blocks)
    assert blocks.num_free == 40 and sorted(blocks.free_blocks) == list(range(40))
    assert all(c == 0 for c in blocks.ref_counts) and not blocks.tables and not blocks.lengths


def test_shared_blocks_are_counted_and_outlive_their_first_owner():
    blocks = BlockManager(num_blocks=10, block_size=4)
    first = blocks.allocate(1, 10)                          # 3 blocks, the first two full
    second = blocks.allocate(2, 9, shared=first[:2])        # borrows them, takes one of its own
    assert second[:2] == first[:2] and second[2] not in first
    assert [blocks.ref_counts[b] for b in first] == [2, 2, 1] and blocks.num_free == 6
    check_books(blocks)
    blocks.free(1)
    assert [blocks.ref_counts[b] for b in first] == [1, 1, 0] and blocks.num_free == 7
    assert first[0] not in blocks.free_blocks and first[2] in blocks.free_blocks
    blocks.free(2)
    check_books(blocks)
    assert blocks.num_free == 10 and all(c == 0 for c in blocks.ref_counts)


def test_allocate_prompt_and_cache_computed_are_chapter_7s_plain_answers():
    """The two calls an engine makes around a prompt: Chapter 7's manager has nothing cached to offer
    (0 tokens computed already) and nothing to remember afterwards; Chapter 8's overrides both."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    assert blocks.caches_prefixes is False
    assert blocks.allocate_prompt(0, list(range(10))) == 0
    assert blocks.tables[0] == [0, 1, 2] and blocks.lengths[0] == 10
    before = snapshot(blocks)
    blocks.cache_computed(0, list(range(10)))
    assert snapshot(blocks) == before
    assert blocks.allocate_prompt(1, list(range(10))) == 0 and blocks.tables[1] == [3, 4, 5]   # no sharing
    check_books(blocks)
    before = snapshot(blocks)
    with pytest.raises(PoolFullError):
        blocks.allocate_prompt(2, list(range(9)))   # 3 blocks, 2 free
    with pytest.raises(ValueError, match="already has blocks"):
        blocks.allocate_prompt(0, [1])
    assert snapshot(blocks) == before                # a refusal changes nothing


def test_full_pool_says_not_now_and_changes_nothing():
    blocks = BlockManager(num_blocks=4, block_size=4)
    blocks.allocate(0, 12)
    assert blocks.can_allocate(4) and not blocks.can_allocate(5)
    before = snapshot(blocks)
    with pytest.raises(PoolFullError, match="blocks needed"):
        blocks.allocate(1, 5)
    assert snapshot(blocks) == before
    blocks.allocate(1, 4)                                   # the last block
    assert blocks.num_free == 0 and not blocks.can_allocate(1)
    before = snapshot(blocks)
    for seq in (0, 1):                                      # both last blocks are full
        with pytest.raises(PoolFullError, match="pool is full"):
            blocks.append_slot(seq)
        assert snapshot(blocks) == before
    blocks.free(1)
    assert blocks.append_slot(0) == blocks.tables[0][3] * 4    # the freed block serves seq 0 at once


def test_bad_arguments_are_value_errors(tiny_model):
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate(0, 8)
    free_block = blocks.free_blocks[0]
    before = snapshot(blocks)
    for call, message in [
        (lambda: blocks.allocate(0, 4), "already has blocks"),
        (lambda: blocks.allocate(1, 0), "cannot allocate 0 tokens"),
        (lambda: blocks.allocate(1, 4, shared=blocks.tables[0]), "2 shared blocks"),   # 8 slots for 4 tokens
        (lambda: blocks.allocate(1, 12, shared=[blocks.tables[0][0], free_block]), "in use"),
        (lambda: blocks.allocate(1, 12, shared=[blocks.tables[0][0]] * 2), "distinct"),
        (lambda: blocks.allocate(1, 12, shared=[99]), "in use"),
        (lambda: blocks.append_slot(5), "sequence 5 has no blocks"),
        (lambda: blocks.free(5), "sequence 5 has no blocks"),
        (lambda: BlockManager(0, 4), "num_blocks >= 1"),
        (lambda: KVPool(tiny_model.config, 4, 0), "block_size >= 1"),
        (lambda: KVPool.from_memory(tiny_model.config, 1000, 16), "less than one block"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    assert snapshot(blocks) == before


def test_pool_size_comes_from_the_memory_budget(tiny_model):
    per_token = tiny_model.config.kv_bytes_per_token(torch.float32)
    pool = KVPool.from_memory(tiny_model.config, 10 * 16 * per_token + 5, 16)
    assert pool.num_blocks == 10 and pool.nbytes == 10 * 16 * per_token


def test_capacity_table_counts_what_fits():
    workload = load_workload()
    table = demo.capacity(workload, 64 << 20, 46080, 16)
    contiguous, per_request, pages = table.values()
    budget = (64 << 20) // 46080
    max_len = workload["max_prompt_tokens"] + max(workload["max_tokens_choices"])
    assert contiguous["fits"] == budget // max_len
    assert pages["fits"] >= 3 * contiguous["fits"]
    assert contiguous["waste"] > per_request["waste"] > pages["waste"] >= 0


# ---------------------------------------------------------------- the engine
TINY_KV = 1 << 20          # 2,048 tokens of the tiny model: 128 blocks of 16


@pytest.fixture(scope="module")
def tiny_paged(tiny_model_dir):
    return engine11.PagedEngine(str(tiny_model_dir), device="cpu", kv_memory=TINY_KV)


@pytest.fixture(scope="module")
def tiny_contiguous(tiny_model_dir):
    return engine10.ModelEngine(str(tiny_model_dir), device="cpu")


def all_free(engine) -> bool:
    return engine.blocks.num_free == engine.blocks.num_blocks and not engine.blocks.tables


def test_greedy_equals_baseline_alone_and_batched(tiny_paged, tiny_engine, reference_prompts):
    batch = tiny_paged.generate_batch(reference_prompts, 12)
    for prompt, got in zip(reference_prompts, batch):
        want = tiny_engine.generate(prompt, 12).output_ids
        assert got.output_ids == want
        assert tiny_paged.generate(prompt, 12).output_ids == want
    assert all_free(tiny_paged)


def test_small_pool_answers_every_prompt_in_chunks(tiny_model_dir, tiny_contiguous, reference_prompts):
    # 12 blocks of 16 tokens: room for a few of the prompts at a time, never all seven.
    per_token = tiny_contiguous.model.config.kv_bytes_per_token(torch.float32)
    small = engine11.PagedEngine(str(tiny_model_dir), device="cpu", kv_memory=12 * 16 * per_token)
    assert small.blocks.num_blocks == 12
    requests = [small.new_request(p, 10) for p in reference_prompts]
    assert all(r.budget == 10 for r in requests)
    chunks = list(small.batch_chunks(requests))
    assert len(chunks) > 1 and chunks[0].start == 0 and chunks[-1].stop == len(reference_prompts)
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))          # consecutive, none skipped
    for chunk in chunks:
        assert sum(small.blocks.blocks_for(r.n_prompt + 10) for r in requests[chunk]) <= 12 or \
            chunk.stop - chunk.start == 1
    params = SamplingParams(stop=("the",))
    got = small.generate_batch(reference_prompts, 10, params)
    want = tiny_contiguous.generate_batch(reference_prompts, 10, params)
    assert [(r.output_ids, r.text, r.finish_reason) for r in got] == \
           [(r.output_ids, r.text, r.finish_reason) for r in want]
    assert all_free(small)


def test_seeded_sampling_is_reproducible_and_equals_chapter_6(tiny_paged, tiny_contiguous, reference_prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11)
    for prompt in reference_prompts[:3]:
        ours = tiny_paged.generate(prompt, 10, params).output_ids
        assert ours == tiny_paged.generate(prompt, 10, params).output_ids
        assert ours == tiny_contiguous.generate(prompt, 10, params).output_ids


def test_stop_strings_and_streaming_behave_as_chapter_6(tiny_paged, tiny_contiguous, reference_prompts):
    params = SamplingParams(stop=("the",))
    for prompt in reference_prompts[:4]:
        got, want = tiny_paged.generate(prompt, 16, params), tiny_contiguous.generate(prompt, 16, params)
        assert (got.output_ids, got.text, got.finish_reason) == (want.output_ids, want.text, want.finish_reason)
    *pieces, result = tiny_paged.generate_stream(reference_prompts[0], 16)
    *want_pieces, want = tiny_contiguous.generate_stream(reference_prompts[0], 16)
    assert pieces == want_pieces and "".join(pieces) == result.text == want.text
    assert result.metrics.output_tokens == len(result.output_ids) and result.metrics.ttft_ms is not None
    assert all_free(tiny_paged)


def test_an_abandoned_stream_gives_its_blocks_back(tiny_paged, reference_prompts):
    stream = tiny_paged.generate_stream(reference_prompts[3], 40, SamplingParams(ignore_eos=True))
    next(stream)
    assert tiny_paged.stats()["kv_blocks_used"] > 0      # its prompt's blocks are held while it runs
    stream.close()
    assert all_free(tiny_paged)


def test_a_batch_refused_half_way_keeps_no_block(tiny_model_dir, tiny_contiguous, reference_prompts):
    per_token = tiny_contiguous.model.config.kv_bytes_per_token(torch.float32)
    small = engine11.PagedEngine(str(tiny_model_dir), device="cpu", kv_memory=12 * 16 * per_token)
    requests = [small.new_request(p, 4) for p in reference_prompts]     # together: more than 12 blocks
    assert sum(small.blocks.blocks_for(r.n_prompt) for r in requests) > 12
    with pytest.raises(PoolFullError):
        next(small.run(requests))                    # run() bypasses batch_chunks: the pool says no
    assert all_free(small)


def test_a_request_that_could_never_fit_is_refused(tiny_model_dir, tiny_contiguous):
    per_token = tiny_contiguous.model.config.kv_bytes_per_token(torch.float32)
    small = engine11.PagedEngine(str(tiny_model_dir), device="cpu", kv_memory=4 * 16 * per_token)   # 64 tokens
    with pytest.raises(ValueError, match="needs 5 KV blocks; the pool has 4"):
        small.generate("hello", 70)
    with pytest.raises(ValueError, match="needs .* KV blocks"):
        small.generate_batch(["hi", "hello " * 60], 8)
    assert all_free(small)
    assert len(small.generate("hello", 60, SamplingParams(ignore_eos=True)).output_ids) == 60
    with pytest.raises(ValueError, match="block_size"):
        engine11.PagedEngine(str(tiny_model_dir), device="cpu", kv_memory=TINY_KV, block_size=0)


def test_engine_spec_loads(tiny_model_dir):
    engine = load_engine("11_paged_kv_engine:PagedEngine", str(tiny_model_dir), device="cpu", kv_memory=TINY_KV)
    assert isinstance(engine, engine11.PagedEngine)
    assert not hasattr(paged, "PagedEngine")                        # 11_paged_kv.py holds the parts only
    assert engine.runner.kv is engine.pool and type(engine.blocks) is BlockManager
    assert engine.pool.num_blocks == TINY_KV // (16 * engine.model.config.kv_bytes_per_token(torch.float32))
    assert engine.features()["prefix_caching"] is False and engine.features()["block_size"] == 16


@pytest.mark.real_model
def test_real_model_greedy_equals_baseline(real_engine, default_model_dir, reference_prompts):
    ours = engine11.PagedEngine(str(default_model_dir), device="cpu", kv_memory=64 << 20)
    batch = ours.generate_batch(reference_prompts, 16)
    for prompt, got in zip(reference_prompts, batch):
        assert got.output_ids == real_engine.generate(prompt, 16).output_ids
    assert all_free(ours)


def test_the_capacity_header_gives_the_pools_whole_blocks_as_the_engine_does():
    header = demo.capacity_header(512 * 2**20, 46_080, 728, 16)
    assert "11,650 token slots as regions, 11,648 in the pool's 728 whole blocks of 16" in header
