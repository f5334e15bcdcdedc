"""Chapter 10: speculative decoding changes the speed, never the output.

Greedy: the engine with speculation gives the same tokens as without, for both drafters and
k in {1, 4, 8}, alone and in a mixed batch, with stop strings, EOS and budgets ending inside
a kept run. Sampling: the acceptance rule draws exactly from the model's distribution (a
chi-squared test, even when the drafter's distribution is far from it). Nothing leaks: every
KV block comes back, after 200 requests and after an abort.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import load_script

sampling = load_script("02_sampling")
contracts = load_script("03_contracts")
decode_loop = load_script("07_decode_loop")
cb13 = load_script("13_continuous_batching_engine")
spec = load_script("14_speculative_decoding")
SamplingParams = contracts.SamplingParams

TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4      # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
PROMPTS = ["Hello, how are you today?", "The cat sat on the mat. The cat sat on the", "One two three one two",
           "Write a list: a, b, c, a, b,", "Summer", "Tell me about the sea and the sea again"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: one torch thread for this file


def make(folder, **kwargs):
    return cb13.ContinuousBatchingEngine(str(folder), device="cpu", kv_memory=2048 * TINY_KV_BYTES_PER_TOKEN,
                                         block_size=8, max_num_seqs=16, max_num_batched_tokens=128, **kwargs)


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
    lookup = spec.NgramProposer(max_ngram=3).lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]      # the latest of two matches
    assert lookup([1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3], 5) == [9, 8, 1, 2, 3]   # ... unless too short
    assert lookup([5, 6, 7, 8, 6, 7], 3) == [8, 6, 7]                  # the longest suffix first
    assert lookup([1, 2, 3, 4], 3) == []                               # nothing to copy
    assert lookup([4, 4, 4, 4], 2) == [4]                              # never past the end


def request(params, drafts, generator=None, history=None):
    r = decode_loop.Request(0, [1, 2], params, 100, detok=None, generator=generator, history=history)
    r.draft_ids = list(drafts)
    return r


def test_greedy_keeps_the_guesses_the_model_agrees_with_then_its_own_token():
    logits = torch.full((4, 10), -5.0)
    for j, best in enumerate([3, 4, 9, 6]):
        logits[j, best] = 5.0
    assert spec.accept_guesses(logits, request(SamplingParams(), [3, 4, 5]), None) == [3, 4, 9]
    assert spec.accept_guesses(logits, request(SamplingParams(), [3, 4, 9]), None) == [3, 4, 9, 6]
    assert spec.accept_guesses(logits, request(SamplingParams(), [7, 4, 9]), None) == [3]


def test_penalties_see_the_guesses_kept_before_them():
    """The second position's repetition penalty must count the first kept guess."""
    vocab = 8
    logits = torch.zeros(2, vocab)
    logits[:, 5], logits[:, 6] = 3.0, 2.0
    params = SamplingParams(frequency_penalty=2.0)
    history = sampling.TokenHistory([0], vocab)
    # Position 0 picks 5; with 5 counted once, position 1 prefers 6 (3 - 2 < 2).
    assert spec.accept_guesses(logits, request(params, [5, 5], history=history), None) == [5, 6]
    assert float(history.output_counts.sum()) == 0     # the request's own history is untouched


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_acceptance_rule_draws_exactly_from_the_models_distribution(drafter):
    """First token after a verification, over many seeded draws: chi-squared against p."""
    params = SamplingParams(temperature=0.9, top_k=5)
    target = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -9.0], [0.0] * 7])
    draft = torch.tensor([-1.0, 0.0, 0.5, 1.0, 3.0, 2.0, 0.0])      # prefers what the target does not
    p = sampling.probabilities(target[0], params)
    q = sampling.probabilities(draft, params)
    gen = torch.Generator().manual_seed(0)
    n, counts = 6000, torch.zeros(7)
    for _ in range(n):
        if drafter == "model":
            guess = int(torch.multinomial(q, 1, generator=gen))
            kept = spec.accept_guesses(target, request(params, [guess], gen), q.unsqueeze(0))
        else:                                        # a lookup's guess is fixed: always token 4
            kept = spec.accept_guesses(target, request(params, [4], gen), None)
        counts[kept[0]] += 1
    support = p > 0
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert counts[~support].sum() == 0               # top-k holds for the rejection draw too
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
            cb13.ContinuousBatchingEngine("/nonexistent/model", **kwargs)


def test_a_busy_step_guesses_less(ngram):
    """The step's guess budget: one request may guess k, 32 running requests guess nothing."""
    speculator = ngram.speculator
    speculator.k = 8
    reqs = [request(SamplingParams(), []) for _ in range(32)]
    for r in reqs:
        r.prompt_ids, r.num_computed, r.new_ids = [1, 2] * 10 + [1], 20, []
    speculator.propose(reqs[:1])
    assert len(reqs[0].draft_ids) == 8
    speculator.propose(reqs)
    assert all(r.draft_ids == [] for r in reqs)


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


def test_guesses_never_starve_a_batch_mate_of_its_decode_or_prefill():
    """Two requests decode, each with 4 guesses; two are mid-prefill with 6 tokens to go. Decodes
    and prefill chunks come first (with 8 tokens a step the old rule fed the decodes 5 and 3 and
    no prefill at all); guesses get only what is left, spread in turn; the rest are dropped."""
    from minivllm.block_manager import BlockManager
    from minivllm.scheduler import Scheduler

    def running(rid, prompt, computed, drafts=()):
        r = decode_loop.Request(rid, list(range(prompt)), SamplingParams(), 50, detok=None, generator=None)
        r.num_computed, r.draft_ids = computed, list(drafts)
        return r

    for budget, expect_guesses, last_chunk in ((8, [0, 0], 0), (14, [0, 0], 6), (18, [2, 2], 6), (19, [3, 2], 6)):
        scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=budget)
        rs = [running(0, 9, 8, [5, 6, 7, 8]), running(1, 9, 8, [5, 6, 7, 8]), running(2, 9, 3), running(3, 9, 3)]
        for r in rs:
            scheduler.blocks.allocate_prompt(r.id, r.tokens(0, r.num_tokens))
            scheduler.running.append(r)
        out = scheduler.schedule()
        fed = dict(zip((r.id for r in out.requests), out.lengths))
        assert fed == {0: 1 + expect_guesses[0], 1: 1 + expect_guesses[1], 2: 6,
                       **({3: last_chunk} if last_chunk else {})}, (budget, fed)
        assert [len(r.draft_ids) for r in rs[:2]] == expect_guesses   # the rest were dropped


@pytest.mark.parametrize("room,accepted", [(3, 3), (6, 5)])
def test_accepted_tokens_count_only_guesses_that_reached_the_output(plain, room, accepted):
    """A verification keeps 5 guesses and adds its own token. When the answer ends three tokens
    in, the guesses after those three never reached the output and are not counted as accepted;
    when all six are emitted, the five guesses are (the sixth is the model's own)."""
    r = plain.new_request(PROMPTS[0], room, SamplingParams(ignore_eos=True))
    r.num_drafted = 5
    work = type("Work", (), {"requests": [r], "lengths": [1]})()
    plain.scheduler.running.append(r)
    plain.blocks.allocate_prompt(r.id, r.tokens(0, r.num_tokens))
    try:
        plain.postprocess(work, [[11, 12, 13, 14, 15, 16]])
    finally:
        if r.id in plain.blocks.tables:
            plain.blocks.free(r.id)
        if r in plain.scheduler.running:
            plain.scheduler.running.remove(r)
    assert r.new_ids == [11, 12, 13, 14, 15, 16][:room] and r.finish_reason == "length"
    assert r.num_accepted == accepted


def test_a_rejection_with_nothing_left_beyond_the_draft_draws_from_the_model():
    """p equal to q (or below it everywhere, by rounding) leaves a residual of zeros, which
    torch.multinomial refuses; the token then comes from p itself."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    r = request(SamplingParams(temperature=1.0, seed=3), [2], generator=torch.Generator().manual_seed(3))
    q = torch.softmax(logits, -1) * 2   # above p everywhere: a rejection leaves nothing beyond q
    for _ in range(20):
        r.draft_ids = [2]
        token = spec.accept_guesses(logits, r, q)[0]
        assert 0 <= token < 4


def test_the_draft_model_catches_up_in_chunks_under_the_step_budget(tiny_model_dir):
    """A long prompt is prefilled by the target in chunks of the step budget; the draft model's
    catch-up on it takes chunks of the same budget, never the whole prompt in one forward."""
    long_prompt = " ".join(f"word{i}" for i in range(60))
    fed, outputs = [], {}
    for method in (None, "draft"):
        engine = cb13.ContinuousBatchingEngine(str(tiny_model_dir), device="cpu", kv_memory=2048 * TINY_KV_BYTES_PER_TOKEN,
                                               block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
                                               speculative=method, num_speculative_tokens=4)
        try:
            if method:
                runner = engine.speculator.proposer.runner
                forward = runner.forward
                runner.forward = lambda rs, starts, lengths, *rest: (fed.append(sum(lengths)),
                                                                     forward(rs, starts, lengths, *rest))[1]
            outputs[method] = [r.output_ids for r in engine.generate_batch([long_prompt, PROMPTS[1]], 12,
                                                                           SamplingParams(ignore_eos=True))]
        finally:
            engine.close()
    assert len(engine.tokenizer(long_prompt).input_ids) > 100
    assert fed and max(fed) <= 32, fed
    assert outputs["draft"] == outputs[None]
