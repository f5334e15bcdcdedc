"""Chapter 2's own decode loop must behave exactly like the HF generate baseline."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import load_script
from kit.engines import load_engine
from minivllm.contracts import BaseOfflineEngine, SamplingParams
from minivllm.output import Request, sample

N_NEW = 24


@pytest.fixture(scope="module")
def loop_mod():
    return load_script("07_decode_loop")


@pytest.fixture(scope="module")
def tiny_loop(loop_mod, tiny_model_dir):
    return loop_mod.DecodeLoopEngine(str(tiny_model_dir), device="cpu")


def assert_same(a, b):
    assert a.output_ids == b.output_ids
    assert a.text == b.text
    assert a.finish_reason == b.finish_reason


def test_is_an_offline_engine(loop_mod, tiny_loop):
    assert isinstance(tiny_loop, BaseOfflineEngine)
    assert isinstance(load_engine("07_decode_loop:DecodeLoopEngine", str(tiny_loop.model_name), device="cpu"),
                      loop_mod.DecodeLoopEngine)


def test_greedy_matches_baseline_on_reference_prompts(tiny_engine, tiny_loop, reference_prompts):
    for prompt in reference_prompts:
        assert_same(tiny_engine.generate(prompt, N_NEW), tiny_loop.generate(prompt, N_NEW))


def test_stop_strings_match_baseline(tiny_engine, tiny_loop, reference_prompts):
    prompt = reference_prompts[0]
    pieces = [tiny_loop.tokenizer.decode([t]) for t in tiny_loop.generate(prompt, 12).output_ids]
    # a whole token, the middle of a token, and a string spanning two tokens
    for stop in (pieces[3], pieces[5].strip()[1:3], pieces[6][-2:] + pieces[7][:2]):
        params = SamplingParams(stop=(stop,))
        ours = tiny_loop.generate(prompt, 12, params)
        assert_same(tiny_engine.generate(prompt, 12, params), ours)
        assert ours.finish_reason == "stop" and stop not in ours.text and len(ours.output_ids) < 12


def test_eos_and_ignore_eos_match_baseline(tiny_engine, tiny_loop, reference_prompts, monkeypatch):
    # The random tiny model never picks the real EOS, so declare one of its greedy tokens to be EOS.
    prompt = reference_prompts[1]
    eos = tiny_loop.generate(prompt, 10).output_ids[4]
    monkeypatch.setattr(tiny_engine, "eos_token_ids", {eos})
    monkeypatch.setattr(tiny_loop.output, "eos_token_ids", {eos})   # our loop's output processor decides
    ours = tiny_loop.generate(prompt, 10)
    assert_same(tiny_engine.generate(prompt, 10), ours)
    assert ours.finish_reason == "stop" and ours.output_ids[-1] == eos   # the EOS token is kept in the ids
    params = SamplingParams(ignore_eos=True)
    ours = tiny_loop.generate(prompt, 10, params)
    assert_same(tiny_engine.generate(prompt, 10, params), ours)
    assert ours.finish_reason == "length" and len(ours.output_ids) == 10


def test_budget_uses_max_tokens(tiny_loop, reference_prompts):
    result = tiny_loop.generate(reference_prompts[0], 20, SamplingParams(max_tokens=3))
    assert len(result.output_ids) == 3 and result.finish_reason == "length"


def test_bad_input_is_a_value_error(tiny_loop):
    for prompt, n in (("", 4), ("hello", 0), ("hello " * 600, 4)):
        with pytest.raises(ValueError):
            tiny_loop.generate(prompt, n)


def test_seeded_sampling_is_reproducible(tiny_loop, reference_prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    first = tiny_loop.generate(reference_prompts[0], 16, params)
    assert tiny_loop.generate(reference_prompts[0], 16, params).output_ids == first.output_ids
    other = tiny_loop.generate(reference_prompts[0], 16, SamplingParams(temperature=1.0, top_p=0.95, seed=8))
    assert other.output_ids != first.output_ids


def test_top_k_1_is_greedy(tiny_loop, reference_prompts):
    params = SamplingParams(temperature=1.0, top_k=1, seed=3)
    for prompt in reference_prompts[:3]:
        assert tiny_loop.generate(prompt, 12, params).output_ids == tiny_loop.generate(prompt, 12).output_ids


def expected_distribution(logits: list[float], temperature: float, k: int, p: float) -> dict[int, float]:
    """Temperature, then top-k, then top-p, written out independently of 02_sampling."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])[:k]
    z = sum(math.exp(scaled[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:                    # smallest prefix of the top-k whose mass reaches p
        kept.append(i)
        mass += math.exp(scaled[i]) / z
        if mass >= p:
            break
    z = sum(math.exp(scaled[i]) for i in kept)
    return {i: math.exp(scaled[i]) / z for i in kept}


def test_sampling_draws_follow_the_filtered_distribution(tiny_loop):
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.8, 1.2]
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.85, seed=0)
    expected = expected_distribution(logits, 0.7, 6, 0.85)
    assert 2 < len(expected) < 6                    # both filters actually cut something here
    request = tiny_loop.output.new_request([1], params, budget=1)
    row = torch.tensor([logits])
    n = 20_000
    counts: dict[int, int] = {}
    for seed in range(n):                   # a draw is a function of (seed, position): vary the seed
        request.seed = seed
        (token,) = sample(row, [request])   # the engines' own sampling path
        counts[token] = counts.get(token, 0) + 1
    assert set(counts) <= set(expected)             # nothing outside the top-k / top-p set
    chi2 = sum((counts.get(i, 0) - n * q) ** 2 / (n * q) for i, q in expected.items())
    # 4 tokens kept, so df = 3 and P(chi2 > 20.5) is about 1e-4. Skipping temperature, top-k or
    # top-p lets a fifth token in; even temperature 0.75 instead of 0.7 expects chi2 near 30.
    assert chi2 < 20.5, (counts, expected)


def test_one_request_object_spans_prompt_and_output(loop_mod, tiny_loop):
    """Chapter 2's Request, the one object every later engine passes around: tokens(start, n) reads
    across the prompt/output boundary, accept() ends it at its budget, result() reports it."""
    output = tiny_loop.output
    r = output.new_request([5, 6, 7], SamplingParams(ignore_eos=True), budget=3, arrival=1.0)
    assert (r.n_prompt, r.num_tokens, r.new_ids, r.finish_reason, r.history) == (3, 3, [], None, None)
    for t, now in ((8, 2.0), (9, 2.5)):
        output.accept(r, t, now)
    assert r.num_tokens == 5 and r.finish_reason is None
    assert r.tokens(0, 5) == [5, 6, 7, 8, 9] and r.tokens(2, 2) == [7, 8] and r.tokens(3, 2) == [8, 9]
    assert r.tokens(4, 10) == [9] and r.prompt_ids == [5, 6, 7]
    output.accept(r, 10, 3.0)
    assert r.finish_reason == "length" and r.new_ids == [8, 9, 10]
    result = output.result(r)
    assert result.output_ids == [8, 9, 10] and result.finish_reason == "length"
    assert (result.metrics.input_tokens, result.metrics.output_tokens) == (3, 3)
    assert result.metrics.ttft_ms == pytest.approx(1000.0) and result.metrics.tpot_ms == pytest.approx(500.0)
    assert Request is loop_mod.Request     # one request type, every chapter
    assert output.new_request([5], SamplingParams(), 2).id != r.id


def test_stream_pieces_join_to_the_text(tiny_loop, reference_prompts):
    for params in (SamplingParams(), SamplingParams(stop=("e",))):
        items = list(tiny_loop.generate_stream(reference_prompts[4], 16, params))
        *pieces, result = items
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == result.text
        assert result.output_ids == tiny_loop.generate(reference_prompts[4], 16, params).output_ids


def test_closing_the_stream_stops_the_loop(tiny_loop, reference_prompts):
    calls = []
    hook = tiny_loop.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        stream = tiny_loop.generate_stream(reference_prompts[0], 40)
        next(stream)
        stream.close()
        assert len(calls) <= 2          # prefill, maybe one decode step; not 40 forward passes
    finally:
        hook.remove()


def test_ttft_and_tpot_are_measured(tiny_loop, reference_prompts):
    metrics = tiny_loop.generate(reference_prompts[0], 8).metrics
    assert metrics.ttft_ms > 0 and metrics.tpot_ms > 0 and metrics.throughput > 0
    assert metrics.output_tokens == 8 and metrics.input_tokens > 0
    assert {"ttft_ms", "tpot_ms"} <= set(metrics.as_dict())


@pytest.mark.real_model
def test_real_model_matches_baseline_on_reference_prompts(loop_mod, engine_mod, default_model_dir,
                                                          reference_prompts):
    # One load: Chapter 1's generate() runs on the very same model object as our loop.
    engine = loop_mod.DecodeLoopEngine(str(default_model_dir), device="cpu")
    reasons = set()
    for prompt in reference_prompts:
        ours = engine.generate(prompt, N_NEW)
        assert_same(engine_mod.BaselineEngine.generate(engine, prompt, N_NEW), ours)
        reasons.add(ours.finish_reason)
    assert reasons == {"stop", "length"}     # some prompt really ended on EOS
