"""Chapter 9: the scheduler alone (no model), then the continuous-batching engine against the baseline.

The scheduler tests drive `13_scheduler.Scheduler` over a real BlockManager with fake sequences:
a fake step marks the scheduled tokens computed and appends a token to every request whose known
tokens are all computed, exactly what the engine's step does with a model in the middle.
The engine tests compare the assembled engine (`minivllm.LLM`) with `04_engine.BaselineEngine` token for token.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from conftest import load_script
from minivllm import LLM
from minivllm.block_manager import BlockManager
from minivllm.contracts import GenerateResult, SamplingParams
from minivllm.model import LlamaModel, ModelConfig
from minivllm.output import Request
from minivllm.scheduler import ScheduledBatch, Scheduler


# ---------------------------------------------------------------- the scheduler, without a model
def fake_request(rid: int, prompt_len: int, budget: int) -> Request:
    """Chapter 2's Request with no text side (no detokenizer): the scheduler needs none."""
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(), budget, detok=None)


def fake_step(s: Scheduler, everyone: list[Request]) -> ScheduledBatch:
    """One scheduler decision and what a model step would do with it; checks every invariant."""
    before = {id(r): r.num_computed for r in s.running}
    work = s.schedule()
    assert work.num_tokens <= s.max_num_batched_tokens
    assert len(work.requests) <= s.max_num_seqs and len(s.running) <= s.max_num_seqs
    assert len(set(map(id, work.requests))) == len(work.requests)
    for r, start, n in zip(work.requests, work.starts, work.lengths):
        assert r in s.running and n >= 1
        assert start == before.get(id(r), 0) == r.num_computed     # it continues where it stopped
        assert start + n <= r.num_tokens
        assert s.blocks.lengths[r.id] >= start + n                # slots exist for what it feeds
        assert len(s.blocks.tables[r.id]) * s.blocks.block_size >= start + n
    for r in work.preempted:
        assert r in s.waiting and r.id not in s.blocks.tables and r.num_computed == 0
    for r, n in zip(work.requests, work.lengths):
        r.num_computed += n
        if r.num_computed == r.num_tokens:                       # its logits give the next token
            r.new_ids.append(7)
            if len(r.new_ids) >= r.budget:
                r.finish_reason = "length"
                s.finish(r)
    # Nothing is ever dropped: every request is finished, waiting or running, exactly once.
    assert not set(map(id, s.running)) & set(map(id, s.waiting))
    for r in everyone:
        assert (r.finish_reason is not None) + (r in s.running) + (r in s.waiting) == 1
    held = {b for r in s.running for b in s.blocks.tables[r.id]}
    assert len(held) + s.blocks.num_free == s.blocks.num_blocks    # no block leaks, none shared
    assert set(s.blocks.tables) == {r.id for r in s.running}
    return work


def run_to_end(s: Scheduler, everyone: list[Request], max_steps: int = 10_000) -> list:
    steps = []
    while s.has_work():
        steps.append(fake_step(s, everyone))
        assert len(steps) < max_steps, "the scheduler stopped making progress"
    return steps


def test_decodes_first_then_prefill_chunks_then_admissions():
    blocks = BlockManager(64, 4)
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=16)
    old = fake_request(0, 20, 5)                    # admitted first, still prefilling (8 of 20 done)
    new = fake_request(1, 3, 5)                     # admitted later, already decoding
    for r in (old, new):
        blocks.allocate(r.id, r.num_tokens)
        s.running.append(r)
    old.num_computed = 8
    new.num_computed, new.new_ids = 3, [7]
    waiting = fake_request(2, 5, 5)
    s.add(waiting)
    work = fake_step(s, [old, new, waiting])
    assert work.requests == [new, old, waiting]
    assert work.starts == [3, 8, 0] and work.lengths == [1, 12, 3]   # the admission gets what is left
    assert work.num_tokens == 16 and work.preempted == []


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    short, long_ = fake_request(0, 3, 10), fake_request(1, 25, 3)
    s.add(short)
    fake_step(s, [short])                           # short's prefill; it decodes from now on
    s.add(long_)
    steps = [fake_step(s, [short, long_]) for _ in range(4)]
    chunks = [(w.starts[w.requests.index(long_)], w.lengths[w.requests.index(long_)]) for w in steps]
    assert chunks == [(0, 7), (7, 7), (14, 7), (21, 4)]
    assert all(w.requests[0] is short and w.lengths[0] == 1 for w in steps)   # never stalled
    assert long_.new_ids == [7]                 # only the last chunk predicted a token
    run_to_end(s, [short, long_])


def test_admission_is_first_come_first_served_while_blocks_are_short():
    blocks = BlockManager(4, 4)
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=32)
    a, b, c = fake_request(0, 12, 4), fake_request(1, 8, 2), fake_request(2, 2, 2)
    for r in (a, b, c):
        s.add(r)
    work = fake_step(s, [a, b, c])
    assert work.requests == [a]                     # b needs 2 blocks, 1 is free: c may not jump it
    assert list(s.waiting) == [b, c]
    run_to_end(s, [a, b, c])
    assert blocks.num_free == 4


def test_token_budget_and_sequence_cap_hold_every_step():
    s = Scheduler(BlockManager(1000, 4), max_num_seqs=3, max_num_batched_tokens=10)
    everyone = [fake_request(i, 1 + 3 * i % 17, 1 + i % 5) for i in range(12)]
    for r in everyone:
        s.add(r)
    steps = run_to_end(s, everyone)
    assert max(len(w.requests) for w in steps) == 3
    assert max(w.num_tokens for w in steps) == 10
    assert all(r.finish_reason for r in everyone) and len(s.blocks.tables) == 0


def test_when_blocks_run_out_the_newest_is_preempted_and_recomputed_later():
    blocks = BlockManager(6, 2)                               # 12 token slots
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = fake_request(0, 4, 6), fake_request(1, 4, 6)             # each alone needs 5 blocks at most
    s.add(a)
    s.add(b)
    fake_step(s, [a, b])                                            # both prefilled: 4 blocks used
    fake_step(s, [a, b])                                            # both decode into their 3rd block
    assert blocks.num_free == 0 and len(b.new_ids) == 2
    assert fake_step(s, [a, b]).preempted == []                     # slot 5 is still in the 3rd block
    work = fake_step(s, [a, b])                                     # a needs a block: b (newest) goes
    assert work.preempted == [b] and work.requests == [a]
    assert b.preemptions == 1 and b.num_computed == 0 and list(s.waiting) == [b]
    assert b.new_ids == [7, 7, 7]                               # its output is kept, not dropped
    assert s.num_preemptions == 1
    steps = run_to_end(s, [a, b])
    # b comes back with everything it had (prompt + 3 generated tokens) as one recompute.
    back = next(w for w in steps if b in w.requests)
    assert back.starts[back.requests.index(b)] == 0 and back.lengths[back.requests.index(b)] == 7
    assert len(a.new_ids) == len(b.new_ids) == 6
    assert blocks.num_free == 6 and not s.has_work()


def test_a_request_alone_can_preempt_itself_and_still_finish():
    blocks = BlockManager(3, 2)
    s = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=4)
    a, b = fake_request(0, 2, 4), fake_request(1, 2, 4)             # 2 + 4 tokens: 3 blocks each
    for r in (a, b):
        s.add(r)
    run_to_end(s, [a, b])
    assert b.preemptions >= 1 and a.preemptions == 0                # the older one always progresses
    assert len(a.new_ids) == len(b.new_ids) == 4 and blocks.num_free == 3


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_never_break_an_invariant(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    blocks = BlockManager(rng.randint(4, 40), block_size)
    max_seqs = rng.randint(1, 8)
    s = Scheduler(blocks, max_seqs, rng.randint(max_seqs, 48))
    capacity = blocks.num_blocks * block_size
    everyone, steps = [], []
    for i in range(40):
        prompt = rng.randint(1, max(1, capacity // 2))
        r = fake_request(i, prompt, rng.randint(1, max(1, capacity - prompt)))
        s.add(r)
        everyone.append(r)
        if rng.random() < 0.5:                                      # staggered arrivals
            steps.append(fake_step(s, everyone))
    steps += run_to_end(s, everyone)
    assert all(len(r.new_ids) == r.budget for r in everyone)
    assert blocks.num_free == blocks.num_blocks and not s.waiting and not s.running


def test_a_request_that_can_never_fit_is_refused_at_add():
    s = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=8)
    s.add(fake_request(0, 10, 6))                                   # 16 tokens: exactly the pool
    with pytest.raises(ValueError, match="never fit"):
        s.add(fake_request(1, 10, 7))
    assert [r.id for r in s.waiting] == [0]


@pytest.mark.parametrize("kwargs", [
    {"max_num_seqs": 0}, {"max_num_seqs": -1}, {"max_num_seqs": 2.5}, {"max_num_seqs": "4"},
    {"max_num_batched_tokens": 0}, {"max_num_batched_tokens": None}, {"max_num_batched_tokens": 1 << 20},
    {"max_num_seqs": True},
    {"max_num_seqs": 8, "max_num_batched_tokens": 4},
])
def test_invalid_scheduler_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        Scheduler(BlockManager(8, 4), **kwargs)


# ---------------------------------------------------------------- the engine, on the tiny model
PROMPTS = ["Hello", "The capital of France is", "Once upon a time, in a land far away, there lived a dragon who",
           "1 2 3 4 5 6 7 8 9 10 11 12 13", "Why is the sky blue?", "a b c d", "Write a haiku about caches."]
BUDGETS = [5, 17, 1, 24, 3, 12, 9]
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4        # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32


def collect(stream, timeout: float = 60.0) -> list:
    """Everything a stream yields, read in a thread so that a hang fails the test instead of the run."""
    box: dict = {}

    def read():
        try:
            box["items"] = list(stream)
        except BaseException as exc:   # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), "the stream never ended"
    if "error" in box:
        raise box["error"]
    return box["items"]


def result_of(stream) -> GenerateResult:
    *pieces, result = collect(stream)
    assert isinstance(result, GenerateResult) and all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == result.text             # the streamed text is the answer
    return result


def assert_same(got: GenerateResult, want: GenerateResult) -> None:
    assert got.output_ids == want.output_ids
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert (got.metrics.input_tokens, got.metrics.output_tokens) == (want.metrics.input_tokens,
                                                                     want.metrics.output_tokens)


def assert_idle(engine, timeout: float = 10.0) -> None:
    """No request left anywhere and every block back in the free list."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not engine.scheduler.has_work() and not engine._by_id and not engine._inbox
                and engine.blocks.num_free == engine.blocks.num_blocks and not engine.blocks.tables):
            return
        time.sleep(0.01)
    pytest.fail(f"the engine never went idle: {engine.stats()}")


class Tracer:
    """Records every step the engine runs (the engine's on_step hook). With hold=True the loop
    waits after its first step until release(): whatever is submitted meanwhile joins one step."""

    def __init__(self, engine, hold: bool = False):
        self.engine, self.steps, self.gate = engine, [], threading.Event()
        if not hold:
            self.gate.set()

    def release(self):
        self.gate.set()

    def __enter__(self):
        self.engine.on_step = self.record
        return self

    def __exit__(self, *exc):
        self.gate.set()
        self.engine.on_step = None

    def record(self, work, events):
        self.steps.append({"ids": [r.id for r in work.requests], "starts": list(work.starts),
                           "lengths": list(work.lengths), "prompt_lens": [len(r.prompt_ids) for r in work.requests],
                           "preempted": [(r.id, len(r.new_ids)) for r in work.preempted],
                           "at": time.monotonic()})
        assert self.gate.wait(30)


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: one torch thread for this file


def make_engine(folder, **kwargs):
    return LLM(str(folder), device="cpu", **kwargs)


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    """No preemption, no chunking: 2,048 token slots, a budget bigger than any prompt."""
    engine = make_engine(tiny_model_dir, kv_memory=2048 * TINY_KV_BYTES_PER_TOKEN, block_size=16,
                         max_num_seqs=8, max_num_batched_tokens=256)
    yield engine
    engine.close()                                        # its loop thread ends: the engine can be freed


@pytest.fixture(scope="module")
def tight(tiny_model_dir):
    """16 blocks of 4 tokens and 8 tokens a step: preemption and chunked prefill all the time."""
    engine = make_engine(tiny_model_dir, kv_memory=16 * 4 * TINY_KV_BYTES_PER_TOKEN, block_size=4,
                         max_num_seqs=4, max_num_batched_tokens=8)
    assert engine.blocks.num_blocks == 16
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def narrow(tiny_model_dir):
    """Two sequences at a time: the rest wait in the queue."""
    engine = make_engine(tiny_model_dir, kv_memory=512 * TINY_KV_BYTES_PER_TOKEN, block_size=8,
                         max_num_seqs=2, max_num_batched_tokens=64)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(tiny_engine):
    """The baseline's answer for (prompt, max_new_tokens, params), each computed once."""
    memo = {}

    def get(prompt, n, params=None):
        if (prompt, n, params) not in memo:
            memo[prompt, n, params] = tiny_engine.generate(prompt, n, params)
        return memo[prompt, n, params]
    return get


@pytest.fixture(scope="module")
def block_prompt(tiny_engine) -> str:
    """A prompt of exactly 16 tokens: a whole number of blocks for block sizes 4, 8 and 16."""
    for k in range(1, 40):
        text = "go " * k + "now"
        if len(tiny_engine.tokenizer(text).input_ids) == 16:
            return text
    raise AssertionError("no 16-token prompt found")


def with_stops(expected, prompts, budgets):
    """Params per prompt: every other one gets a stop string taken from the middle of its own answer."""
    params = []
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        text = expected(p, n).text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        params.append(SamplingParams(stop=(stop,)) if i % 2 == 0 and stop.strip() and n > 2 else None)
    return params


def test_submitted_mixed_budgets_and_stop_strings_equal_the_baseline(roomy, expected, block_prompt):
    prompts, budgets = PROMPTS + [block_prompt], BUDGETS + [10]
    params = with_stops(expected, prompts, budgets)
    streams = [roomy.submit(p, n, sp) for p, n, sp in zip(prompts, budgets, params)]
    results = [result_of(s) for s in streams]
    for p, n, sp, got in zip(prompts, budgets, params, results):
        assert_same(got, expected(p, n, sp))
    assert sum(r.finish_reason == "stop" for r in results) >= 2            # the stops really fired
    assert {len(r.output_ids) for r in results} >= {1, 24}
    assert_idle(roomy)


def test_generate_batch_and_generate_equal_the_baseline(roomy, expected):
    with Tracer(roomy) as trace:
        results = roomy.generate_batch(PROMPTS, 12)
    for p, got in zip(PROMPTS, results):
        assert_same(got, expected(p, 12))
    assert max(len(s["ids"]) for s in trace.steps) == len(PROMPTS)           # they really shared steps
    assert_same(roomy.generate(PROMPTS[2], 7), expected(PROMPTS[2], 7))
    assert_idle(roomy)


def test_requests_built_first_and_submitted_together_share_their_first_step(roomy, expected):
    """new_request checks and tokenises in the caller's thread (text, or ids tokenised already);
    submit_all hands the built requests over in one go, so they join one step; output.result(r)
    is the answer each stream ends with."""
    ids = roomy.tokenizer(PROMPTS[1]).input_ids
    requests = [roomy.new_request(PROMPTS[0], 6), roomy.new_request(ids, 6), roomy.new_request(PROMPTS[2], 6),
                roomy.new_request(PROMPTS[3], 6, SamplingParams(max_tokens=4))]
    assert [r.budget for r in requests] == [6, 6, 6, 4] and len({r.id for r in requests}) == 4
    assert requests[1].prompt_ids == ids and all(r.num_computed == 0 and r.admitted is None for r in requests)
    with Tracer(roomy) as trace:
        streams = roomy.submit_all(requests)
        results = [result_of(s) for s in streams]
    assert trace.steps[0]["ids"] == [r.id for r in requests]                # all four in the first step
    for p, n, r, got in zip(PROMPTS[:4], (6, 6, 6, 4), requests, results):
        assert_same(got, expected(p, n))
        assert roomy.output.result(r).output_ids == got.output_ids and r.finish_reason == got.finish_reason
    assert roomy.features() == {"engine": "LLM", "quant": "float32", "max_num_seqs": 8,
                                "kv_memory": roomy.pool.nbytes, "block_size": 16, "prefix_caching": False,
                                "max_num_batched_tokens": 256, "compile": False}
    assert_idle(roomy)


def test_forced_preemption_and_chunked_prefill_still_equal_the_baseline(tight, expected, block_prompt):
    prompts, budgets = PROMPTS + [block_prompt], BUDGETS + [20]
    params = with_stops(expected, prompts, budgets)
    with Tracer(tight, hold=True) as trace:
        streams = [tight.submit(p, n, sp) for p, n, sp in zip(prompts, budgets, params)]
        trace.release()                                   # all but the first join the second step
        results = [result_of(s) for s in streams]
    for p, n, sp, got in zip(prompts, budgets, params, results):
        assert_same(got, expected(p, n, sp))
    assert sum(s.request.preemptions for s in streams) > 0
    # Some request was preempted after it had generated tokens: it recomputed them, same output.
    assert any(n_out > 0 for s in trace.steps for _, n_out in s["preempted"])
    # Some prompt was split: a chunk that starts inside the prompt, after its first token.
    assert any(0 < start < plen for s in trace.steps for start, plen in zip(s["starts"], s["prompt_lens"]))
    assert max(sum(s["lengths"]) for s in trace.steps) <= 8
    assert max(len(s["ids"]) for s in trace.steps) <= 4
    assert tight.stats()["preemptions"] >= sum(s.request.preemptions for s in streams)
    assert_idle(tight)


def test_penalties_bias_and_logprobs_survive_preemption_and_chunks(tight, expected):
    first = expected(PROMPTS[1], 12).output_ids[0]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
              SamplingParams(logit_bias={first: -100.0}, logprobs=2), SamplingParams(logprobs=0)]
    jobs = [(p, 16, sp) for p in PROMPTS[1:4] for sp in params]
    with Tracer(tight, hold=True) as trace:
        streams = [tight.submit(p, n, sp) for p, n, sp in jobs]
        trace.release()
        results = [result_of(s) for s in streams]
    for (p, n, sp), got in zip(jobs, results):
        want = expected(p, n, sp)
        assert_same(got, want)
        if sp.logprobs is not None:
            assert [e.token_id for e in got.logprobs] == got.output_ids
            assert [len(e.top) for e in got.logprobs] == [sp.logprobs] * len(got.output_ids)
            assert got.logprobs[0].logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-3)
    assert results[1].output_ids[0] != first                                # the bias was applied
    assert sum(s.request.preemptions for s in streams) > 0
    assert_idle(tight)


def test_more_prompts_than_max_num_seqs_queue_and_still_equal_the_baseline(narrow, expected):
    with Tracer(narrow) as trace:
        results = narrow.generate_batch(PROMPTS, 6)
    for p, got in zip(PROMPTS, results):
        assert_same(got, expected(p, 6))
    assert max(len(s["ids"]) for s in trace.steps) == 2
    assert_idle(narrow)


def test_staggered_arrivals_get_the_same_answer_as_alone(tight, expected):
    with Tracer(tight) as trace:
        first = tight.submit(PROMPTS[2], 24)
        head = next(first)                                # it is decoding now
        later = [tight.submit(p, n) for p, n in zip(PROMPTS[3:6], (10, 6, 12))]
        rest = collect(first)
        results = [result_of(s) for s in later]
    assert_same(rest[-1], expected(PROMPTS[2], 24))
    assert head + "".join(rest[:-1]) == rest[-1].text
    for p, n, got in zip(PROMPTS[3:6], (10, 6, 12), results):
        assert_same(got, expected(p, n))
    # The late ones joined while the first was still running.
    assert any(first.request_id in s["ids"] and later[0].request_id in s["ids"] for s in trace.steps)
    assert_idle(tight)


def test_seeded_sampling_is_reproducible_whatever_the_batch_mates(roomy, tight):
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234)
    alone = roomy.generate(PROMPTS[1], 16, params)
    mates = [(p, n, SamplingParams(temperature=1.0, seed=i) if i % 2 else None)
             for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
    streams = [tight.submit(p, n, sp) for p, n, sp in mates[:3]]
    ours = tight.submit(PROMPTS[1], 16, params)
    streams += [tight.submit(p, n, sp) for p, n, sp in mates[3:]]
    twin = tight.submit(PROMPTS[1], 16, params)
    busy = result_of(ours)
    for s in streams:
        result_of(s)
    assert busy.output_ids == alone.output_ids == result_of(twin).output_ids
    assert busy.text == alone.text
    other = roomy.generate(PROMPTS[1], 16, SamplingParams(temperature=0.9, top_k=50, seed=4321))
    assert other.output_ids != alone.output_ids                          # the seed matters
    assert_idle(tight)


def test_closing_a_stream_or_abort_frees_every_block_by_the_next_step(narrow):
    endless = SamplingParams(ignore_eos=True)
    with Tracer(narrow) as trace:
        a = narrow.submit("Hello", 400, endless)
        b = narrow.submit("Hi there", 400, endless)
        next(a)
        next(b)
        a.close()
        closed_at = time.monotonic()
        narrow.abort(b.request_id)
        rest_a, rest_b = collect(a), collect(b)
    assert not any(isinstance(x, GenerateResult) for x in rest_a + rest_b)
    assert len(a.request.new_ids) < 400 and len(b.request.new_ids) < 400
    # At most the step already under way when close() came still had it.
    assert sum(a.request_id in s["ids"] for s in trace.steps if s["at"] > closed_at) <= 1
    assert_idle(narrow)
    a.close()                                             # closing twice, or after the end, is harmless
    narrow.abort(12345678)                                # an unknown id too
    c = narrow.submit("Hello", 400, endless)
    narrow.abort(c.request_id)
    with pytest.raises(RuntimeError, match="aborted"):
        c.result()
    assert_idle(narrow)


def test_a_waiting_request_can_be_aborted_before_it_ever_runs(narrow, expected):
    endless = SamplingParams(ignore_eos=True)
    with Tracer(narrow) as trace:
        runners = [narrow.submit("Hello", 60, endless) for _ in range(2)]
        queued = narrow.submit("Never scheduled", 60, endless)
        next(runners[0])
        queued.close()
        assert collect(queued) == [] and queued.request.admitted is None
        for r in runners:
            r.close()
            collect(r)
    assert all(queued.request_id not in s["ids"] for s in trace.steps)
    assert_idle(narrow)
    assert_same(narrow.generate(PROMPTS[0], 5), expected(PROMPTS[0], 5))    # and it keeps serving


def test_an_abandoned_stream_is_aborted_and_frees_its_blocks(narrow):
    stream = narrow.submit("Hello", 400, SamplingParams(ignore_eos=True))
    request = stream.request
    next(stream)
    del stream                                            # the reader went away without closing
    assert_idle(narrow)
    assert len(request.new_ids) < 400
    pieces = narrow.generate_stream("Hello", 400, SamplingParams(ignore_eos=True))
    next(pieces)
    pieces.close()                                        # the generator's close reaches the request
    assert_idle(narrow)


def test_two_hundred_requests_leave_nothing_behind(roomy):
    streams = []
    for i in range(200):
        streams.append(roomy.submit(PROMPTS[i % len(PROMPTS)], 1 + i % 6))
        if i % 40 == 39:                                  # read some while more arrive
            for s in streams[-40:]:
                if s.request_id % 7 == 0:
                    s.close()
                    collect(s)
                elif s.request_id % 11 != 0:              # the 11s are never read
                    result_of(s)
    assert_idle(roomy, timeout=30)
    assert roomy.stats()["waiting"] == roomy.stats()["running"] == 0
    assert len(roomy.recent_batches) <= roomy.recent_batches.maxlen


def test_bad_input_raises_in_the_caller_and_never_reaches_the_scheduler(tight, monkeypatch):
    seen = []
    monkeypatch.setattr(tight.scheduler, "add", seen.append)
    with pytest.raises(ValueError, match="non-empty"):
        tight.submit("", 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tight.submit("Hello", 0)
    with pytest.raises(ValueError, match="context length"):
        tight.submit("word " * 600, 5)                    # longer than the model's 512 positions
    with pytest.raises(ValueError, match="KV blocks"):
        tight.submit("Hello", 200)                        # fits the model, never the 64-slot pool
    with pytest.raises(ValueError):
        tight.generate_batch(["Hello", ""], 5)            # one bad prompt: none of them runs
    with pytest.raises(ValueError, match="list of strings"):
        tight.generate_batch("Hello", 5)
    with pytest.raises(ValueError):
        list(tight.generate_stream("Hello", -3))
    assert seen == []
    assert_idle(tight)


@pytest.mark.parametrize("kwargs", [{"max_num_seqs": 0}, {"max_num_batched_tokens": 0},
                                    {"max_num_seqs": 8, "max_num_batched_tokens": 4}, {"block_size": 0},
                                    {"kv_memory": 100}])
def test_bad_engine_arguments_raise_value_error(tiny_model_dir, kwargs):
    with pytest.raises(ValueError):
        make_engine(tiny_model_dir, **{"kv_memory": 1 << 20, **kwargs})


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(roomy, expected, monkeypatch):
    real_forward, calls = roomy.model.forward, []

    def forward_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(roomy.model, "forward", forward_failing_once)
    with pytest.raises(RuntimeError, match="boom"):
        roomy.generate_batch(PROMPTS[:3], 8)
    assert_idle(roomy)
    assert_same(roomy.generate(PROMPTS[1], 8), expected(PROMPTS[1], 8))
    stream = roomy.submit(PROMPTS[0], 4)
    assert_same(result_of(stream), expected(PROMPTS[0], 4))


def test_a_failing_step_spares_the_requests_still_waiting(narrow, expected, monkeypatch):
    real_forward, failed = narrow.model.forward, []

    def forward_failing_on_a_pair(batch, *args, **kwargs):
        if len(batch.lengths) == 2 and not failed:
            failed.append(1)
            raise RuntimeError("boom")
        return real_forward(batch, *args, **kwargs)

    monkeypatch.setattr(narrow.model, "forward", forward_failing_on_a_pair)
    pair = [narrow.submit(p, 20, SamplingParams(ignore_eos=True)) for p in PROMPTS[:2]]
    queued = narrow.submit(PROMPTS[2], 6)                 # max_num_seqs=2: it waits behind the pair
    for s in pair:
        with pytest.raises(RuntimeError, match="boom"):
            collect(s)
    assert_same(result_of(queued), expected(PROMPTS[2], 6))
    assert_idle(narrow)


def test_a_failure_after_a_request_finished_in_that_step_still_reaches_its_reader(roomy, expected):
    def tracer_that_fails(work, events):
        raise RuntimeError("tracer broke")

    roomy.on_step = tracer_that_fails
    try:
        stream = roomy.submit(PROMPTS[0], 1)              # finishes in its first step, then the hook fails
        with pytest.raises(RuntimeError, match="tracer broke"):
            collect(stream, timeout=20)
    finally:
        roomy.on_step = None
    assert_idle(roomy)
    assert_same(roomy.generate(PROMPTS[0], 3), expected(PROMPTS[0], 3))


def test_close_fails_what_is_in_flight_ends_the_loop_and_a_later_submit_restarts_it(narrow, expected):
    endless = SamplingParams(ignore_eos=True)
    running = [narrow.submit("Hello", 60, endless) for _ in range(2)]
    queued = narrow.submit("Wait for me", 60, endless)
    next(running[0])
    loop = narrow._thread
    narrow.close()
    assert not loop.is_alive() and narrow._thread is None
    for s in running + [queued]:
        with pytest.raises(RuntimeError, match="closed"):
            collect(s)
    assert_idle(narrow)
    narrow.close()                                        # closing a closed engine is harmless
    assert_same(narrow.generate(PROMPTS[3], 6), expected(PROMPTS[3], 6))
    assert narrow._thread is not loop and narrow._thread.is_alive()


def test_metrics_have_ttft_tpot_and_queue_time(narrow):
    streams = [narrow.submit(p, 8, SamplingParams(ignore_eos=True)) for p in PROMPTS[:3]]
    results = [result_of(s) for s in streams]
    for r in results:
        m = r.metrics
        assert m.ttft_ms > 0 and m.tpot_ms > 0 and m.queue_ms >= 0 and m.throughput > 0
        assert m.ttft_ms >= m.queue_ms and m.output_tokens == 8
        assert {"ttft_ms", "tpot_ms", "queue_ms"} <= set(m.as_dict())
    # Only two run at once: the third waited for a place, at least one other request's whole life.
    assert results[2].metrics.queue_ms > results[0].metrics.ttft_ms
    assert_idle(narrow)


def test_eos_as_the_very_first_token(narrow, tiny_engine, expected):
    first = expected(PROMPTS[4], 4).output_ids[0]
    saved = narrow.output.eos_token_ids, tiny_engine.eos_token_ids     # our loop's output processor decides
    narrow.output.eos_token_ids, tiny_engine.eos_token_ids = saved[0] | {first}, saved[1] | {first}
    try:
        got, want = narrow.generate(PROMPTS[4], 4), tiny_engine.generate(PROMPTS[4], 4)
    finally:
        narrow.output.eos_token_ids, tiny_engine.eos_token_ids = saved
    assert got.output_ids == want.output_ids == [first] and got.finish_reason == want.finish_reason == "stop"
    assert got.text == want.text
    assert_idle(narrow)


# ---------------------------------------------------------------- the real model, briefly
@pytest.mark.real_model
def test_real_model_with_preemption_and_chunks_equals_the_baseline(real_engine, default_model_dir,
                                                                    reference_prompts):
    import json

    import torch

    config = ModelConfig.from_json(json.loads((default_model_dir / "config.json").read_text()))
    prompts, budgets = reference_prompts[:3], [6, 8, 10]            # 5, 16 and 18 prompt tokens
    need = [-(-(len(real_engine.tokenizer(p).input_ids) + n) // 4) for p, n in zip(prompts, budgets)]
    # Room for the biggest request alone, not for all three: the newest gets preempted.
    engine = make_engine(default_model_dir, kv_memory=max(need) * 4 * config.kv_bytes_per_token(torch.float32),
                         block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    params = SamplingParams(ignore_eos=True)
    try:
        with Tracer(engine, hold=True) as trace:
            streams = [engine.submit(p, n, params) for p, n in zip(prompts, budgets)]
            trace.release()
            results = [result_of(s) for s in streams]
    finally:
        engine.close()
    for p, n, got in zip(prompts, budgets, results):
        assert_same(got, real_engine.generate(p, n, params))
    assert engine.stats()["preemptions"] > 0
    assert any(0 < start < plen for s in trace.steps for start, plen in zip(s["starts"], s["prompt_lens"]))
    assert_idle(engine)


def test_matmul_bound_times_every_weight_matmul_once(tiny_model_dir):
    """13_matmul_bound (and Chapter 12's ceiling) time a forward's weight matmuls alone: each layer's four
    matrices with `tokens` rows and the LM head with one row per sampling sequence, nothing skipped."""
    bound = load_script("13_matmul_bound")
    model = LlamaModel.from_folder(tiny_model_dir)
    seen = []
    real_linear = model.linear
    model.linear = lambda x, name: seen.append((name, tuple(x.shape))) or real_linear(x, name)
    assert bound.matmuls_ms(model, tokens=5, heads=2) > 0
    c = model.config
    expected = [(f"model.layers.{i}.{n}", (5, c.intermediate_size if n == "down" else c.hidden_size))
                for i in range(c.num_layers) for n in ("qkv", "o", "gate_up", "down")]
    assert seen == expected + [("lm_head", (2, c.hidden_size))]


def test_the_scheduler_walkthrough_marks_every_request_finished_once(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["13_scheduler.py"])
    load_script("13_scheduler").main()
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  step")]
    marks = [r for line in steps if "finished" in line for r in line.split("finished ")[1].split(", ")]
    assert sorted(marks) == ["r0", "r1", "r2", "r3"]
    assert "finished r3" in steps[-1]   # the last step ends the last request


def test_a_tenant_of_sixteen_requests_does_not_hold_back_anothers_one():
    """max_num_seqs 4: alice sends 16 at once, then bob one. Bob's takes the next free seat, not
    the seventeenth: he finishes before more than half of alice's."""
    s = Scheduler(BlockManager(1000, 4), max_num_seqs=4, max_num_batched_tokens=64)
    alice = [Request(i, list(range(100, 108)), SamplingParams(cache_salt="key-0"), 6 + i % 3, detok=None) for i in range(16)]
    for r in alice:
        s.add(r)
    fake_step(s, alice)
    bob = Request(99, list(range(100, 108)), SamplingParams(cache_salt="key-1/own"), 6, detok=None)
    s.add(bob)
    everyone = alice + [bob]
    while bob.finish_reason is None:
        fake_step(s, everyone)
    done_before_bob = sum(r.finish_reason is not None for r in alice)
    assert done_before_bob <= 8, done_before_bob
    run_to_end(s, everyone)
