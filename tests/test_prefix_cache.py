"""12_prefix_cache.py: outputs identical with the cache on and off, shared blocks never written,
eviction and reference counts, no leak, collisions harmless, cached_tokens reported (engine, server)."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from conftest import load_script
from minivllm import LLM, prefix_cache
from minivllm.contracts import SamplingParams
from minivllm.kv_cache import PoolFullError
from minivllm.output import Request
from minivllm.scheduler import Scheduler
from minivllm.text import render_chat

engine12 = load_script("12_prefix_cache_engine")
server = load_script("05_server")

BS = 4                      # small blocks: short prompts span many of them
GREEDY = SamplingParams(ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: one torch thread for this file


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return engine12.PrefixCachingEngine(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, block_size=BS)


def run_ids(engine, ids: list[int], n: int = 6, caching: bool = True) -> tuple[list[int], int]:
    """Generate from token ids through the engine's own loop: (new ids, cached prompt tokens)."""
    engine.prefix_caching = caching
    try:
        request = engine.output.new_request(list(ids), GREEDY, n)
        for _ in engine.run([request]):
            pass
    finally:
        engine.prefix_caching = True
    return request.new_ids, request.cached_tokens


def fresh_cache(engine) -> None:
    engine.blocks = prefix_cache.PrefixCachingBlockManager(engine.pool.num_blocks, BS)


def check_invariants(m: prefix_cache.PrefixCachingBlockManager) -> None:
    """Every block is in exactly one place, and a reference count is the number of tables holding it."""
    holders = [0] * m.num_blocks
    for table in m.tables.values():
        for b in table:
            holders[b] += 1
    free, evictable = set(m.free_blocks), set(m.evictable)
    assert len(free) == len(m.free_blocks) and not free & evictable
    for b in range(m.num_blocks):
        assert m.ref_counts[b] == holders[b], f"block {b}: ref {m.ref_counts[b]}, held by {holders[b]}"
        assert (b in free) + (b in evictable) + (holders[b] > 0) == 1, f"block {b} is in two places or none"
        if b in evictable:
            assert b in m.content          # only cached content is worth keeping
    for h, b in m.by_hash.items():
        assert m.content[b].hash == h


PREFIX = list(range(1000, 1024))             # 24 tokens: 6 full blocks


@pytest.mark.parametrize("name, ids, cached", [
    ("no shared block", [7, 8, 9] + PREFIX[3:], 0),
    ("one shared block", PREFIX[:4] + [5, 6, 7, 8, 9, 10, 11], 4),
    ("several shared blocks", PREFIX[:14] + [5, 6, 7, 8], 12),
    ("all full blocks shared", PREFIX + [99, 98, 97], 24),
    ("an exact prefix of the cached prompt", PREFIX[:10], 8),
    ("the same prompt, block-aligned: its last block is recomputed", PREFIX, 20),
    ("a block-aligned prefix of it", PREFIX[:16], 12),
])
def test_output_with_the_cache_equals_output_without(engine, name, ids, cached):
    fresh_cache(engine)
    run_ids(engine, PREFIX)                          # computes and caches PREFIX's full blocks
    off, _ = run_ids(engine, ids, caching=False)
    on, hit = run_ids(engine, ids)
    assert hit == cached, name
    assert on == off, name
    check_invariants(engine.blocks)


def test_switching_the_cache_off_and_on_keeps_what_it_holds(engine):
    """Off answers as Chapter 7's manager (nothing offered, nothing published, no cached_tokens reported)
    on the cache's own books, so its blocks keep their K/V; on again, they are found. Switching is refused
    while requests hold blocks; reset_prefix_cache forgets everything and keeps the switch where it was."""
    fresh_cache(engine)
    run_ids(engine, PREFIX)
    cached, cache = dict(engine.blocks.content), engine.blocks
    engine.prefix_caching = False
    try:
        assert engine.prefix_caching is False and engine.features()["prefix_caching"] is False
        assert "prefix_cache_hit_rate" not in engine.stats()
        request = engine.output.new_request(PREFIX + [5, 6], GREEDY, 6)
        for _ in engine.run([request]):
            pass
        assert request.cached_tokens is None and engine.blocks.content == cached    # nothing published
        check_invariants(cache)
    finally:
        engine.prefix_caching = True
    assert engine.blocks is cache
    on, hit = run_ids(engine, PREFIX + [5, 6])
    assert hit == 24 and on == request.new_ids
    engine.prefix_caching = True                         # on already: the same cache
    assert engine.blocks is cache
    loop = engine.run([engine.output.new_request(PREFIX, GREEDY, 40)])
    next(loop)
    for switch in (lambda: setattr(engine, "prefix_caching", False), engine.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="hold blocks"):
            switch()
    loop.close()
    with pytest.raises(ValueError, match="True or False"):
        engine.prefix_caching = 1
    engine.prefix_caching = False
    engine.reset_prefix_cache()
    assert engine.prefix_caching is False and engine.blocks.content == {}
    engine.prefix_caching = True
    assert run_ids(engine, PREFIX)[1] == 0                # forgotten
    check_invariants(engine.blocks)


def test_generated_tokens_are_cached_too_for_the_next_turn(engine):
    fresh_cache(engine)
    first, _ = run_ids(engine, PREFIX[:6], n=12)                 # 18 tokens in all: 4 full blocks
    turn2 = PREFIX[:6] + first + [3, 4, 5]
    off, _ = run_ids(engine, turn2, caching=False)
    on, hit = run_ids(engine, turn2)
    assert hit == 16 and on == off


class WriteSpy:
    """Wraps the model: records the blocks each forward writes, and fails if one is shared or cached."""

    def __init__(self, engine):
        self.engine, self.inner, self.max_shared = engine, engine.model.forward, 0

    def __call__(self, batch, cache, *args, **kwargs):
        m = self.engine.blocks
        for block in {int(s) // BS for s in batch.slots}:
            assert m.ref_counts[block] == 1, f"block {block} is written while {m.ref_counts[block]} sequences use it"
            assert block not in m.content, f"cached block {block} is written"
        self.max_shared = max(self.max_shared, max(m.ref_counts))
        return self.inner(batch, cache, *args, **kwargs)


def test_a_block_shared_by_running_sequences_is_never_written(engine, monkeypatch):
    fresh_cache(engine)
    spy = WriteSpy(engine)
    monkeypatch.setattr(engine.model, "forward", spy)
    system = "You are a careful assistant. Answer in one short sentence. " * 3
    engine.generate(system + "First question?", 4, GREEDY)              # the system prompt is cached
    results = engine.generate_batch([system + q for q in ("Why?", "How so?", "Where is it?", "When?")],
                                    10, GREEDY)
    assert spy.max_shared >= 4                  # four running sequences really shared blocks
    assert all(r.metrics.cached_tokens > 0 for r in results)
    monkeypatch.undo()
    engine.prefix_caching = False
    try:
        assert [r.output_ids for r in results] == \
            [r.output_ids for r in engine.generate_batch([system + q for q in ("Why?", "How so?", "Where is it?",
                                                                                "When?")], 10, GREEDY)]
    finally:
        engine.prefix_caching = True


def test_cached_tokens_are_reported_and_the_cache_fills_up(engine):
    fresh_cache(engine)
    system = "Answer briefly. The library opens at nine and closes at eight. " * 2
    first = engine.generate(system + "When does it open?", 5, GREEDY)
    second = engine.generate(system + "When does it close?", 5, GREEDY)
    assert first.metrics.cached_tokens == 0
    a, b = (engine.tokenizer(system + q).input_ids for q in ("When does it open?", "When does it close?"))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert second.metrics.cached_tokens == common // BS * BS     # every full block of the common prefix
    assert second.metrics.as_dict()["cached_tokens"] == second.metrics.cached_tokens
    stats = engine.stats()
    assert stats["prefix_cache_blocks"] > 0 and stats["kv_blocks_used"] == 0
    assert 0 < stats["prefix_cache_hit_rate"] < 1


def test_seeded_sampling_is_the_same_with_the_cache_on_and_off(engine):
    fresh_cache(engine)
    prompt, params = "Tell me a story about a lighthouse keeper. " * 3, SamplingParams(
        temperature=0.9, top_p=0.95, seed=11)
    engine.generate(prompt + "Begin.", 4)                            # caches the shared part
    engine.prefix_caching = False
    try:
        off = engine.generate(prompt + "Go on.", 12, params)
    finally:
        engine.prefix_caching = True
    on = engine.generate(prompt + "Go on.", 12, params)
    assert on.metrics.cached_tokens > 0 and on.output_ids == off.output_ids


def test_an_abandoned_stream_leaves_every_block_free_or_evictable(engine):
    fresh_cache(engine)
    stream = engine.generate_stream("A long answer, please: " * 4, 40, GREEDY)
    next(stream)
    assert engine.blocks.tables                                      # it is running
    stream.close()
    m = engine.blocks
    assert not m.tables and len(m.free_blocks) + len(m.evictable) == m.num_blocks
    check_invariants(m)


def test_eviction_under_a_small_pool_keeps_outputs_right(engine):
    small = engine
    small.blocks = prefix_cache.PrefixCachingBlockManager(12, BS)     # 48 token slots: the cache must evict
    rng = random.Random(1)
    heads = [[rng.randrange(50, 5000) for _ in range(8)] for _ in range(3)]
    for _ in range(12):
        ids = rng.choice(heads) + [rng.randrange(50, 5000) for _ in range(rng.randrange(1, 10))]
        off, _ = run_ids(small, ids, n=5, caching=False)
        on, _ = run_ids(small, ids, n=5)
        assert on == off
        check_invariants(small.blocks)
    assert small.blocks.hit_tokens > 0 and len(small.blocks.evictable) > 0


@pytest.mark.parametrize("fake_hash", [lambda parent, tokens: 42,                # every block collides
                                       lambda parent, tokens: hash(tokens)],     # the parent is ignored
                         ids=["constant", "parent-blind"])
def test_hash_collisions_cost_a_miss_never_a_wrong_answer(engine, monkeypatch, fake_hash):
    fresh_cache(engine)
    monkeypatch.setattr(prefix_cache, "block_hash", fake_hash)   # where the block manager looks it up
    run_ids(engine, PREFIX)
    # Same tokens as PREFIX's 2nd and 3rd blocks, but at the start: their cached K/V belong elsewhere.
    for ids in (PREFIX[4:12] + [1, 2, 3], [1, 2, 3, 4] + PREFIX[4:], PREFIX[:8] + [5, 6, 7]):
        off, _ = run_ids(engine, ids, caching=False)
        on, hit = run_ids(engine, ids)
        assert on == off
        assert hit <= (8 if ids[:8] == PREFIX[:8] else 0)
        check_invariants(engine.blocks)


def test_a_thousand_random_requests_leak_nothing():
    m = prefix_cache.PrefixCachingBlockManager(40, BS)
    rng = random.Random(0)
    stems = [[rng.randrange(100) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    running: dict[int, list[int]] = {}
    for seq_id in range(1000):
        tokens = rng.choice(stems)[:rng.randrange(1, 30)] + [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
        fits = m.can_allocate_prompt(tokens)        # the scheduler's question, asked before allocating
        try:
            hit = m.allocate_prompt(seq_id, tokens)
        except PoolFullError:
            assert m.blocks_for(len(tokens)) > m.num_free and not fits
        else:
            assert fits
            assert hit % BS == 0 and hit < len(tokens)
            assert tokens[:hit] == [t for b in m.tables[seq_id][:hit // BS] for t in m.content[b].tokens]
            running[seq_id] = tokens
            m.cache_computed(seq_id, tokens[:rng.randrange(hit, len(tokens) + 1)])
        for sid in list(running):                 # the others decode a token, finish or are preempted
            roll = rng.random()
            if roll < 0.3:
                m.free(sid)
                del running[sid]
            elif roll < 0.7:
                try:
                    m.append_slot(sid)
                    running[sid].append(rng.randrange(100))
                    m.cache_computed(sid, running[sid])
                except PoolFullError:
                    m.free(sid)
                    del running[sid]
        check_invariants(m)
    for sid in running:
        m.free(sid)
    check_invariants(m)
    assert len(m.free_blocks) + len(m.evictable) == m.num_blocks and not m.tables
    assert m.hit_tokens > 0 and len(m.evictable) > 0


def test_admission_counts_the_blocks_a_prompt_finds_cached():
    """10 blocks of 4. A's 30 tokens hold 8 blocks, 7 of them full and cached; 2 are free. B starts
    with A's first 28 tokens: it shares 7 blocks and needs 1, so the scheduler admits it now. C's
    prefix is cached too, but in blocks nobody holds: sharing them takes them off the evictable
    list, so they do not count as room as well, and C waits instead of failing to allocate."""
    blocks = prefix_cache.PrefixCachingBlockManager(10, BS)
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)

    def request(rid, prompt):
        return Request(rid, prompt, GREEDY, 2, detok=None)

    stem = list(range(100, 128))                              # 7 blocks
    a, b = request(0, stem + [1, 2]), request(1, stem + [3, 4])
    s.add(a)
    assert s.schedule().requests == [a]
    a.num_computed = a.num_tokens
    blocks.cache_computed(a.id, a.tokens(0, a.num_tokens))    # after its prefill: 7 blocks findable
    a.new_ids.append(7)
    s.add(b)
    assert blocks.num_free == 2 and not blocks.can_allocate(b.num_tokens)   # a whole prompt's worth is not free
    work = s.schedule()
    assert work.requests == [a, b] and b.num_computed == 28 and work.lengths == [1, 2]
    assert blocks.tables[b.id][:7] == blocks.tables[a.id][:7] and blocks.num_free == 1

    s.finish(a)
    s.finish(b)                                               # 7 shared blocks evictable, 3 free
    x = request(2, list(range(200, 208)))                     # 2 blocks of other tokens: 1 left free
    s.add(x)
    s.schedule()
    c = request(3, stem + list(range(6)))                     # 7 cached blocks (all evictable) + 2 new
    s.add(c)
    assert blocks.num_free == 8 and not blocks.can_allocate_prompt(c.tokens(0, c.num_tokens))
    assert c not in s.schedule().requests and list(s.waiting) == [c]
    s.finish(x)
    assert c in s.schedule().requests and c.num_computed == 28


def test_bad_calls_are_value_errors():
    m = prefix_cache.PrefixCachingBlockManager(8, BS)
    with pytest.raises(ValueError, match="0 tokens"):
        m.allocate_prompt(1, [])
    m.allocate_prompt(1, [1, 2, 3])
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate_prompt(1, [1, 2, 3])
    with pytest.raises(ValueError, match="holds slots for 3"):
        m.cache_computed(1, [1, 2, 3, 4])
    m.free(1)
    for call in (lambda: m.free(1), lambda: m.cache_computed(1, [1])):
        with pytest.raises(ValueError, match="has no blocks"):
            call()


def test_the_server_reports_cached_tokens_like_openai(engine):
    fresh_cache(engine)
    messages = [{"role": "system", "content": "You answer questions about the library, briefly. " * 3}]
    with TestClient(server.make_app(engine, model_name="tiny")) as client:
        bodies = [client.post("/v1/chat/completions", json={
            "messages": messages + [{"role": "user", "content": q}], "max_tokens": 4}).json()
            for q in ("Hours?", "Fees?")]
    details = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    assert details[0] == 0 and details[1] >= 16
    assert bodies[1]["metrics"]["cached_tokens"] == details[1]


@pytest.mark.real_model
def test_real_model_with_cache_hits_equals_the_baseline(real_engine, default_model_dir, reference_prompts):
    ours = engine12.PrefixCachingEngine(str(default_model_dir), device="cpu", kv_memory=64 << 20)
    long = max(reference_prompts, key=len)
    cached = []
    for prompt in (long, long, long + " The next morning"):        # a miss, a full hit, an extension
        got = ours.generate(prompt, 16)
        assert got.output_ids == real_engine.generate(prompt, 16).output_ids
        cached.append(got.metrics.cached_tokens)
    n = len(ours.tokenizer(long).input_ids)
    assert cached[0] == 0 and cached[1] == (n - 1) // 16 * 16 and cached[2] >= cached[1]
# ---------------------------------------------------------------- under Chapter 9's scheduler
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4      # 2 layers, 2 KV heads, head_dim 16, float32
CHAT = ["Why is the sky blue?", "Name three rivers.", "What is a prime number?", "Say hello.",
        "Count to five.", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def cb_engines(tiny_model_dir):
    """Continuous batching with the cache and without; 24 blocks of 4 tokens and 8 tokens a step:
    chunked prefills, preemption and eviction all the time."""
    made = [LLM(str(tiny_model_dir), device="cpu", kv_memory=24 * 4 * TINY_KV_BYTES_PER_TOKEN,
                block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                prefix_caching=on) for on in (True, False)]
    yield made
    for e in made:
        e.close()


def test_continuous_batching_with_the_cache_equals_without(cb_engines):
    on, off = cb_engines
    assert isinstance(on.blocks, prefix_cache.PrefixCachingBlockManager) and on.scheduler.blocks is on.blocks
    system = "Be brief. " * 4
    prompts = [system + q for q in CHAT] + [system + CHAT[0]]       # the last one repeats the first
    spy = WriteSpy(on)
    on.model.forward = spy                                          # an instance attribute: undone below
    try:
        with_cache = on.generate_batch(prompts, 8, GREEDY)
        again = on.generate_batch(prompts[:2], 8, GREEDY)            # a later batch finds the prefix cached
    finally:
        del on.model.forward
    without = off.generate_batch(prompts, 8, GREEDY)
    assert [r.output_ids for r in with_cache] == [r.output_ids for r in without]
    assert [r.output_ids for r in again] == [r.output_ids for r in without[:2]]
    assert all(r.metrics.cached_tokens is None for r in without)
    assert with_cache[0].metrics.cached_tokens == 0 and all(r.metrics.cached_tokens > 0 for r in again)
    assert sum(r.metrics.cached_tokens for r in with_cache[1:]) > 0  # chunked prefill let later ones share
    m = on.blocks
    assert not m.tables and len(m.free_blocks) + len(m.evictable) == m.num_blocks   # nothing leaked
    check_invariants(m)


def test_a_preempted_request_re_matches_its_own_blocks(cb_engines):
    on, off = cb_engines
    preempted = []
    on.on_step = lambda work, events: preempted.extend(work.preempted)
    try:
        hits_before = on.blocks.hit_tokens
        prompts = [q * 3 for q in CHAT[:4]]
        results = on.generate_batch(prompts, 12, GREEDY)
    finally:
        on.on_step = None
    assert preempted, "the pool was meant to be too small for all four at once"
    first_admissions = sum(r.metrics.cached_tokens for r in results)
    assert on.blocks.hit_tokens - hits_before > first_admissions    # re-admissions found their own blocks
    assert [r.output_ids for r in results] == [r.output_ids for r in off.generate_batch(prompts, 12, GREEDY)]
    check_invariants(on.blocks)


def test_continuous_batching_reports_cached_tokens_through_the_server(cb_engines):
    on, _ = cb_engines
    messages = [{"role": "system", "content": "Be brief."}]
    with TestClient(server.make_app(on, model_name="tiny")) as client:
        bodies = [client.post("/v1/chat/completions", json={
            "messages": messages + [{"role": "user", "content": q}], "max_tokens": 4}).json() for q in ("Hi?", "Yo?")]
    render = render_chat
    a, b = (on.tokenizer(render(on.tokenizer, messages + [{"role": "user", "content": q}])).input_ids
            for q in ("Hi?", "Yo?"))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert [body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies] == [0, common // BS * BS]
    assert 0 < on.stats()["prefix_cache_hit_rate"] < 1


def test_demo_measures_hits_and_shared_blocks_and_keeps_outputs(tiny_model_dir, tmp_path, capsys):
    """12_prefix_cache_demo on the tiny model: the questions after the first find the system prompt cached,
    every turn of a conversation finds the turns before it, all at once the prompts share blocks, and
    off/on outputs agree (off_and_on exits otherwise)."""
    demo = load_script("12_prefix_cache_demo")
    workload = demo.load_workload()
    engine = engine12.PrefixCachingEngine(str(tiny_model_dir), device="cpu", kv_memory=8 << 20, block_size=16)
    qa = demo.shared_system_prompt(engine, workload, 3, 2)
    assert qa[0]["cached"] == 0 and all(r["cached"] >= r["prompt_tokens"] // 2 for r in qa[1:])
    engine.reset_prefix_cache()
    chat_workload = {"system": "You are terse.", "conversation": ["Hi there.", "What is 2+2?", "And 3+3?"]}
    chat = demo.conversation(engine, chat_workload, 2)
    assert chat[0]["cached"] == 0 and all(r["cached"] > 0 for r in chat[1:])
    without, shared = demo.blocks_if_concurrent(engine, workload, 3)
    assert shared < without
    demo.summarize(engine, qa, chat, workload)
    assert f"{without - shared} saved" in capsys.readouterr().out
    demo.plot(qa, chat, str(tmp_path / "ch8.png"))
    assert (tmp_path / "ch8.png").read_bytes()[:4] == b"\x89PNG"


def test_a_salt_keeps_equal_prompts_apart():
    """vLLM's cache_salt: the salt enters the first block's hash, so the same text under another
    salt finds nothing, and under the same salt finds everything but the last block."""
    from minivllm.prefix_cache import PrefixCachingBlockManager

    m = PrefixCachingBlockManager(32, 4)
    tokens = list(range(13))
    assert m.allocate_prompt(0, tokens, salt="tenant A") == 0
    m.cache_computed(0, tokens)
    assert m.allocate_prompt(1, tokens, salt="tenant B") == 0       # other tenant: nothing shared
    assert m.allocate_prompt(2, tokens) == 0                         # no salt is a tenant of its own
    assert m.allocate_prompt(3, tokens, salt="tenant A") == 12       # same tenant: 3 full blocks
    assert m.can_allocate_prompt(tokens, "tenant A") and m.match(tokens)[0] == []


def test_the_ttft_summary_names_the_reference_of_each_ratio():
    demo = load_script("12_prefix_cache_demo")
    against_first, against_off = demo.ttft_lines(1450.0, 139.0, 1357.0, 16)
    assert "request 1 (nothing cached yet) 1450 ms; requests 2-16 139 ms on average, 0.10x request 1's" in against_first
    assert against_off.endswith("139 ms with the cache, 1357 ms without it (0.10x)")
    with pytest.raises(ValueError):
        demo.ttft_lines(0.0, 139.0, 1357.0, 16)
