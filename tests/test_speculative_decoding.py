"""Chapter 10: speculative decoding changes the speed, never the output.

Greedy: the engine with speculation gives the same tokens as without, for both drafters and
k in {1, 4, 8}, alone and in a mixed batch, with stop strings, EOS and budgets ending inside
a kept run. Sampling: every token is the model's own draw at its position (a chi-squared test,
even when the drafter's distribution is far from it), so a seeded request samples the same
tokens alone and among 20 others. Guesses take only the budget that the step has left; the
draft model catches up in chunks of it; accepted_tokens counts the guesses that were emitted.
Nothing leaks: every KV block comes back, after 200 requests and after an abort."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import load_script
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.output import Request
from minivllm.packed import packed_weights
from minivllm.sampling import TokenHistory, probabilities
from minivllm.speculative import NgramProposer, accept_guesses, draw


TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4      # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
PROMPTS = ["Hello, how are you today?", "The cat sat on the mat. The cat sat on the", "One two three one two",
           "Write a list: a, b, c, a, b,", "Summer", "Tell me about the sea and the sea again"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: one torch thread for this file


def make(folder, **kwargs):
    options = {"max_num_seqs": 16, "max_num_batched_tokens": 128, **kwargs}
    return LLM(str(folder), device="cpu", kv_memory=2048 * TINY_KV_BYTES_PER_TOKEN,
               block_size=8, **options)


class Oracle:
    """A drafter that knows the answer: it guesses the engine's own greedy tokens, so with a
    tiny random model (whose text never repeats, so prompt lookup finds nothing) every
    verification of a greedy request keeps all its guesses."""

    def __init__(self, answers: dict[tuple, list[int]]):
        self.answers = answers                    # prompt ids -> the greedy output

    def propose(self, requests, ks, *rest):
        for r, k in zip(requests, ks):
            r.draft_ids = list(self.answers[tuple(r.prompt_ids)][len(r.new_ids):len(r.new_ids) + k]) if k else []
        return [None] * len(requests)

    def release(self, request) -> None:
        pass


def oracle_for(plain, prompts, max_new_tokens):
    answers = plain.generate_batch(prompts, max_new_tokens, SamplingParams(ignore_eos=True))
    return Oracle({tuple(plain.new_request(p, max_new_tokens).prompt_ids): a.output_ids
                   for p, a in zip(prompts, answers)}), answers


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = make(tiny_model_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ngram(tiny_model_dir):
    engine = make(tiny_model_dir, speculative="ngram", num_speculative_tokens=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def draft(tiny_model_dir):
    engine = make(tiny_model_dir, speculative="draft", num_speculative_tokens=4)   # this model on int4
    yield engine
    engine.close()


def assert_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        drafter = engine.speculator.proposer
        if (not engine.scheduler.has_work() and engine.blocks.num_free == engine.blocks.num_blocks
                and not engine.blocks.tables and not getattr(drafter, "computed", None)):
            return
        time.sleep(0.01)
    pytest.fail(f"the engine never went idle: {engine.stats()}")


# ---------------------------------------------------------------- the parts
def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = NgramProposer(max_ngram=3).lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]      # the latest of two matches
    assert lookup([1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3], 5) == [9, 8, 1, 2, 3]   # ... unless too short
    assert lookup([5, 6, 7, 8, 6, 7], 3) == [8, 6, 7]                  # the longest suffix first
    assert lookup([1, 2, 3, 4], 3) == []                               # nothing to copy
    assert lookup([4, 4, 4, 4], 2) == [4]                              # never past the end


def request(params, drafts, seed=0, history=None):
    r = Request(0, [1, 2], params, 100, detok=None, seed=seed, history=history)
    r.draft_ids = list(drafts)
    return r


def test_greedy_keeps_the_guesses_the_model_agrees_with_then_its_own_token():
    logits = torch.full((4, 10), -5.0)
    for j, best in enumerate([3, 4, 9, 6]):
        logits[j, best] = 5.0
    assert accept_guesses(logits, request(SamplingParams(), [3, 4, 5])) == ([3, 4, 9], 2)
    assert accept_guesses(logits, request(SamplingParams(), [3, 4, 9])) == ([3, 4, 9, 6], 3)
    assert accept_guesses(logits, request(SamplingParams(), [7, 4, 9])) == ([3], 0)


def test_penalties_see_the_guesses_kept_before_them():
    """The second position's repetition penalty must count the first kept guess."""
    vocab = 8
    logits = torch.zeros(2, vocab)
    logits[:, 5], logits[:, 6] = 3.0, 2.0
    params = SamplingParams(frequency_penalty=2.0)
    history = TokenHistory([0], vocab)
    # Position 0 picks 5; with 5 counted once, position 1 prefers 6 (3 - 2 < 2).
    assert accept_guesses(logits, request(params, [5, 5], history=history))[0] == [5, 6]
    assert float(history.output_counts.sum()) == 0     # the request's own history is untouched


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_a_sampled_token_is_the_models_own_draw_whatever_was_guessed(drafter):
    """First token after a verification, over many seeds: always the token the model draws at
    that position with no guess at all, so distributed as p (chi-squared), even when the
    drafter's q is far from p."""
    params = SamplingParams(temperature=0.9, top_k=5)
    target = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -9.0], [0.0] * 7])
    draft = torch.tensor([-1.0, 0.0, 0.5, 1.0, 3.0, 2.0, 0.0])      # prefers what the target does not
    p = probabilities(target[0], params)
    q = probabilities(draft, params)
    n, counts = 4000, torch.zeros(7)
    for seed in range(n):
        guess = draw(q, seed, 0) if drafter == "model" else 4   # a lookup's guess is fixed: token 4
        kept, _ = accept_guesses(target, request(params, [guess], seed=seed))
        assert kept[0] == draw(p, seed, 0)
        counts[kept[0]] += 1
    support = p > 0
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert counts[~support].sum() == 0               # top-k holds
    assert chi2 < 20.5, (counts, expected)           # 4 degrees of freedom: P(chi2 > 20.5) ~ 4e-4


# ---------------------------------------------------------------- the engine: same tokens
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("which", ["ngram", "draft"])
def test_greedy_output_is_unchanged_alone_and_in_a_mixed_batch(plain, ngram, draft, which, k):
    engine = {"ngram": ngram, "draft": draft}[which]
    engine.speculator.k = k
    endless = SamplingParams(ignore_eos=True)
    for prompt in PROMPTS[:3]:
        a, b = plain.generate(prompt, 40, endless), engine.generate(prompt, 40, endless)
        assert a.output_ids == b.output_ids and a.text == b.text
    # 16 requests at once, with budgets, stop strings and a likely EOS ending inside kept runs.
    eos = plain.tokenizer.eos_token_id
    params = [SamplingParams(ignore_eos=True, max_tokens=3 + i) for i in range(6)] + \
             [SamplingParams(logit_bias={eos: 4.0})] * 4 + [SamplingParams(repetition_penalty=1.3)] * 2
    stops = [plain.generate(p, 30, endless).text[12:15] for p in PROMPTS[:4]]
    params += [SamplingParams(ignore_eos=True, stop=[s]) for s in stops if s.strip()]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    expected = [plain.generate(p, 30, sp) for p, sp in zip(prompts, params)]
    streams = engine.submit_all([engine.new_request(p, 30, sp) for p, sp in zip(prompts, params)])
    got = [s.result() for s in streams]
    for a, b in zip(expected, got):
        assert (a.output_ids, a.text, a.finish_reason) == (b.output_ids, b.text, b.finish_reason)
    assert sum(r.metrics.draft_tokens or 0 for r in got) > 0
    assert_idle(engine)


def test_seeded_sampling_with_speculation_is_reproducible(draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    a, b = draft.generate(PROMPTS[0], 30, params), draft.generate(PROMPTS[0], 30, params)
    assert a.output_ids == b.output_ids and a.metrics.draft_tokens


def test_logprobs_come_one_per_kept_token(plain, ngram):
    params = SamplingParams(logprobs=2, ignore_eos=True)
    a, b = plain.generate(PROMPTS[1], 24, params), ngram.generate(PROMPTS[1], 24, params)
    assert [e.token_id for e in b.logprobs] == b.output_ids == a.output_ids
    assert [round(e.logprob, 4) for e in a.logprobs] == [round(e.logprob, 4) for e in b.logprobs]
    streamed = [p for p in ngram.generate_stream(PROMPTS[1], 24, params) if isinstance(p, str)]
    assert [e.token_id for p in streamed for e in getattr(p, "logprobs", ())] == b.output_ids


# ---------------------------------------------------------------- nothing leaks
def test_no_block_is_left_after_200_requests(ngram, draft):
    for engine in (ngram, draft):
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i % 3) for i in range(100)]
        results = engine.generate_batch(prompts, 12, SamplingParams(ignore_eos=True))
        assert all(len(r.output_ids) == 12 for r in results)
        assert_idle(engine)


def test_aborting_mid_verification_frees_everything(draft):
    stream = draft.submit(PROMPTS[1], 400, SamplingParams(ignore_eos=True))
    next(stream)
    next(stream)
    stream.close()
    assert_idle(draft)
    assert len(stream.request.new_ids) < 400


def test_options_are_checked_before_a_model_loads():
    for kwargs, message in [({"speculative": "medusa"}, "speculative must be one of"),
                            ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                            ({"speculative": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
                            ({"speculative": "ngram", "draft_model": "x"}, "draft_model needs")]:
        with pytest.raises(ValueError, match=message):
            LLM("/nonexistent/model", **kwargs)


def test_a_busy_step_guesses_less(ngram):
    """The step's guess budget: one request may guess k, 32 running requests guess nothing; and
    a short token budget is shared one guess at a time in turn."""
    from minivllm.scheduler import ScheduledBatch

    speculator = ngram.speculator
    speculator.k = 8
    reqs = [request(SamplingParams(), []) for _ in range(32)]
    for i, r in enumerate(reqs):
        r.id, r.prompt_ids, r.num_computed, r.new_ids = 1000 + i, [1, 2] * 10 + [1], 20, []
    decodes = lambda rs: ScheduledBatch(rs, [20] * len(rs), [1] * len(rs), [])   # noqa: E731
    speculator.propose(decodes(reqs[:1]), 256)
    assert len(reqs[0].draft_ids) == 8
    speculator.propose(decodes(reqs), 256)
    assert all(r.draft_ids == [] for r in reqs)
    speculator.propose(decodes(reqs[:4]), 10)            # 6 tokens left after the 4 decodes
    assert [len(r.draft_ids) for r in reqs[:4]] == [2, 2, 1, 1]


def test_the_server_reports_drafted_and_accepted_tokens(draft):
    from fastapi.testclient import TestClient

    server = load_script("05_server")
    draft.speculator.k = 4
    with TestClient(server.make_app(draft)) as client:
        body = {"prompt": PROMPTS[1], "max_tokens": 40, "ignore_eos": True}
        usage = client.post("/v1/completions", json=body).json()["usage"]
        details = usage["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0
        metrics = client.get("/metrics").text
        drafted = float(metrics.split("\nllm_spec_decode_draft_tokens_total ")[1].split()[0])
        accepted = float(metrics.split("\nllm_spec_decode_accepted_tokens_total ")[1].split()[0])
        assert drafted == sum(details.values()) and accepted == details["accepted_prediction_tokens"]
        features = client.get("/engine/stats").json()["features"]
        assert features["speculative"] == "draft"


@pytest.mark.parametrize("which", ["ngram", "draft"])
def test_guesses_that_break_a_grammar_are_rejected(plain, ngram, draft, which):
    """Chapter 11 with speculation: the same constrained tokens as without, and valid JSON."""
    import json

    engine = {"ngram": ngram, "draft": draft}[which]
    engine.speculator.k = 4
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "tags"]}
    for params in (SamplingParams(structured={"json_schema": schema}),
                   SamplingParams(structured={"json_schema": schema}, temperature=0.9, seed=3)):
        a, b = plain.generate(PROMPTS[0], 60, params), engine.generate(PROMPTS[0], 60, params)
        assert set(json.loads(b.text)) == {"name", "tags"}
        if params.is_greedy:
            assert a.output_ids == b.output_ids
    assert_idle(engine)


# ---------------------------------------------------------------- the step's budget, the counts, the seeds
def test_guesses_never_cost_a_batch_mate_its_token(tiny_model_dir, plain):
    """A budget of 8 tokens and four requests: every step feeds every request that is not done (its
    decode token or its prompt's chunk), as without speculation; guesses get only what is left."""
    prompts = ["a b a b a b", "c d c d c d", "e f e f e f", "g h g h g h"]
    oracle, expected = oracle_for(plain, prompts, 30)
    engine = make(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=8, speculative="ngram",
                  num_speculative_tokens=4)
    engine.speculator.proposer = oracle
    steps = []   # per step: requests fed, requests not finished before it, tokens fed
    engine.on_step = lambda work, events: steps.append((
        len(work.requests), len(engine.scheduler.running) + len(engine.scheduler.waiting)
        + sum(1 for r in work.requests if r.finish_reason), sum(work.lengths)))
    try:
        got = engine.generate_batch(prompts, 30, SamplingParams(ignore_eos=True))
    finally:
        engine.close()
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert sum(r.metrics.draft_tokens or 0 for r in got) > 0
    # Steps 0 and 1 admit the prompts (6 + 2 tokens, then 1 + 4 + 3); from step 2 on, all are fed.
    assert steps[0][1] == 4 and all(fed == alive for fed, alive, _ in steps[2:]), steps
    assert all(tokens <= 8 for _, _, tokens in steps) and any(tokens > fed for fed, _, tokens in steps)


def test_accepted_tokens_count_only_guesses_that_reached_the_output(plain, ngram):
    """k = 8 guesses, all right, and a stop string at output token m: m guesses were emitted
    (token 0 came from the prompt's forward), not the 8 that were kept."""
    oracle, (answer,) = oracle_for(plain, [PROMPTS[0]], 30)
    ids, decode = answer.output_ids, plain.tokenizer.decode
    m = next(m for m in range(3, 8) if decode(ids[m]).strip() and decode(ids[m]) not in decode(ids[:m]))
    saved, ngram.speculator.proposer, ngram.speculator.k = ngram.speculator.proposer, oracle, 8
    try:
        got = ngram.generate(PROMPTS[0], 30, SamplingParams(ignore_eos=True, stop=[decode(ids[m])]))
    finally:
        ngram.speculator.proposer = saved
    assert got.output_ids == ids[:m + 1] and got.finish_reason == "stop"
    assert (got.metrics.draft_tokens, got.metrics.accepted_tokens) == (8, m)


def test_the_draft_catches_up_in_chunks_under_the_token_budget(plain, draft):
    """A long prompt: the target prefills it in chunks of the step's budget (128 here), and so
    does the draft model when it catches up; the output is unchanged."""
    runner = draft.speculator.proposer.runner
    fed, forward = [], runner.forward
    runner.forward = lambda requests, starts, lengths, *rest: (fed.append(sum(lengths)),
                                                               forward(requests, starts, lengths, *rest))[1]
    draft.speculator.k = 4
    prompt = " ".join(f"item {i % 37} is on shelf {i % 11}." for i in range(45))
    endless = SamplingParams(ignore_eos=True)
    try:
        got = draft.generate(prompt, 24, endless)
    finally:
        del runner.forward
    assert got.metrics.input_tokens > 3 * 128
    assert got.output_ids == plain.generate(prompt, 24, endless).output_ids
    assert max(fed) <= 128 and got.metrics.draft_tokens, fed


def test_a_seeded_request_samples_the_same_alone_and_among_20_others(plain, ngram, draft):
    """Its tokens depend on its seed and positions only: not on its batch mates, nor on how many
    guesses it was given, nor on who guessed them (a lookup that guesses the greedy answer, a
    draft model). Batch mates: 10 sampled without a seed, 10 greedy."""
    oracle, _ = oracle_for(plain, PROMPTS, 30)
    params = SamplingParams(temperature=0.8, seed=7)
    saved, ngram.speculator.proposer = ngram.speculator.proposer, oracle
    outputs = []
    try:
        for engine in (ngram, draft):
            engine.speculator.k = 4
            alone = engine.generate(PROMPTS[1], 30, params)
            mates = [engine.new_request(PROMPTS[i % len(PROMPTS)], 30,
                                        SamplingParams(temperature=0.8) if i % 2 else SamplingParams())
                     for i in range(20)]
            mine = engine.new_request(PROMPTS[1], 30, params)
            streams = engine.submit_all(mates[:10] + [mine] + mates[10:])
            crowd = [s.result() for s in streams][10]
            assert alone.metrics.draft_tokens and crowd.output_ids == alone.output_ids
            outputs.append(alone.output_ids)
    finally:
        ngram.speculator.proposer = saved
    assert outputs[0] == outputs[1] == plain.generate(PROMPTS[1], 30, params).output_ids   # and as without guesses


def test_prompt_lookup_cuts_its_guesses_at_the_first_token_the_grammar_forbids(ngram):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    params = SamplingParams(structured={"json_schema": schema})
    # The prompt ends in "KEY\n", which came before '{"name": 1}': the lookup proposes the
    # object, whose 1 the schema forbids (a string is required).
    r = ngram.new_request('KEY\n{"name": 1}\nKEY\n', 20, params)
    raw = ngram.speculator.proposer.lookup(r.prompt_ids, 8)
    ngram.speculator.proposer.propose([r], [8], 128)
    assert 0 < len(r.draft_ids) < len(raw) and r.draft_ids == raw[:len(r.draft_ids)]
    for token in r.draft_ids:                     # every guess is one the grammar allows, in turn
        assert r.constraint.accept(token)
    assert not r.constraint.allowed(raw[len(r.draft_ids)])


def test_the_demos_trace_and_table_count_what_was_emitted(plain, ngram, capsys):
    """The request ends (an EOS, made of its output token m) inside a run of 8 kept guesses: the
    trace's lines, its summary and the table's tokens per forward all count the m emitted."""
    import re

    demo = load_script("14_speculative_decoding_demo")
    oracle, (answer,) = oracle_for(plain, [PROMPTS[0]], 30)
    ids = answer.output_ids
    m = next(m for m in range(4, 8) if ids[m] not in ids[:m])
    saved, eos = ngram.speculator.proposer, plain.output.eos_token_ids
    ngram.speculator.proposer, ngram.speculator.k = oracle, 8
    plain.output.eos_token_ids = ngram.output.eos_token_ids = eos | {ids[m]}
    try:
        demo.show_trace(ngram, PROMPTS[0], plain.tokenizer, 30)
        (row,) = demo.sweep(plain, {"oracle": ngram}, [PROMPTS[0]], [8], 30)
    finally:
        ngram.speculator.proposer, plain.output.eos_token_ids, ngram.output.eos_token_ids = saved, eos, eos
    out = capsys.readouterr().out
    lines = [int(kept) for kept in re.findall(r"^\s+\d+\s+(\d+)/\d+", out, re.MULTILINE)]
    summary = re.search(r"(\d+) tokens in (\d+) forwards of the model; (\d+) of (\d+) guesses kept", out)
    assert lines == [0, m] and summary.groups() == (str(m + 1), "2", str(m), "8"), out
    assert row["tokens_per_forward"] == (m + 1) / 2 and row["acceptance"] == m / 8


def test_through_the_server_a_seeded_request_with_a_draft_model_ignores_its_batch_mates(draft):
    """The same through the HTTP API, as a client sees it: a seeded sampled completion alone, then
    the same request among 7 others sent at once, with speculative='draft': the same text."""
    import asyncio

    import httpx

    server = load_script("05_server")
    app = server.make_app(draft)
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0.8, "seed": 7, "ignore_eos": True}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            alone = (await client.post("/v1/completions", json=body)).json()
            others = [{**body, "prompt": PROMPTS[i % len(PROMPTS)], "seed": 100 + i} for i in range(7)]
            answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in [*others[:3], body,
                                                                                           *others[3:]]))
            return alone, answers[3].json()

    alone, crowded = asyncio.run(scenario())
    assert alone["choices"][0]["text"] and alone["usage"]["completion_tokens"] == 24
    assert crowded["choices"][0]["text"] == alone["choices"][0]["text"]


class WrongFor(Oracle):
    """The oracle, except for one prompt, whose guesses are always wrong (a token its greedy
    answer never takes at that position)."""

    def __init__(self, answers, wrong: tuple):
        super().__init__(answers)
        self.wrong = wrong

    def propose(self, requests, ks, *rest):
        super().propose(requests, ks, *rest)
        for r in requests:
            if tuple(r.prompt_ids) == self.wrong:
                r.draft_ids = [(t + 1) % 50 for t in r.draft_ids]


def test_a_request_whose_guesses_never_match_rests_and_one_whose_guesses_match_does_not(tiny_model_dir, plain):
    """60 decode steps. The right guesser's request is verified at every step it decodes; the
    wrong one's after m misses in a row sits out 2**(m-1) - 1 steps (at most MAX_REST): verified
    at decode steps 1, 2, 4, 8, 16, 32, 48 — seven times, not sixty. Output is the same either way."""
    prompts = [PROMPTS[0], PROMPTS[4]]
    oracle, expected = oracle_for(plain, prompts, 61)
    wrong = tuple(plain.new_request(prompts[1], 61).prompt_ids)
    engine = make(tiny_model_dir, speculative="ngram", num_speculative_tokens=1)
    engine.speculator.proposer = WrongFor(oracle.answers, wrong)
    try:
        got = engine.generate_batch(prompts, 61, SamplingParams(ignore_eos=True))
        assert not engine.speculator.misses and not engine.speculator.resting   # forgotten on leaving
    finally:
        engine.close()
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    right_one, wrong_one = got
    assert right_one.metrics.accepted_tokens == right_one.metrics.draft_tokens >= 30
    assert (wrong_one.metrics.draft_tokens, wrong_one.metrics.accepted_tokens) == (7, 0)


def test_the_demos_verification_cost_times_other_weights_and_puts_the_model_back(plain):
    """Chapter 13's packed weights swapped in for the timing only: the model keeps its own after."""
    demo = load_script("14_speculative_decoding_demo")
    model = plain.runner.model
    own, free = model.w, plain.blocks.num_free
    cost = demo.verification_cost(plain, sizes=(1, 3), context=8, rounds=1, weights=packed_weights(model))
    assert set(cost) == {1, 3} and all(ms > 0 for ms in cost.values())
    assert model.w is own and plain.blocks.num_free == free
