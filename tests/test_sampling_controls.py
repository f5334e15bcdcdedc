"""Logit bias, the three penalties and log-probabilities: one meaning in Chapter 1's functions,
in HF generate (the baseline) and in our own loop (Chapter 2, shared by every later engine)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from conftest import load_script
from kit.engines import load_engine
from minivllm import LLM, output
from minivllm.contracts import SamplingParams
from minivllm.sampling import (TokenHistory, adjust_logits, apply_logit_bias, apply_presence_frequency,
                               apply_repetition_penalty, token_logprobs)

N_NEW = 8

# The tiny random model never repeats itself within a few tokens, so a penalty on repeats
# would change nothing. A bias that makes token 30 win every step gives the penalties work.
PUSH = {30: 9.0}
ADJUSTED = {   # name: (the settings, what the answer is compared with to see that they matter)
    "repetition": (dict(repetition_penalty=2.0, logit_bias=PUSH), dict(logit_bias=PUSH)),
    "repetition<1": (dict(repetition_penalty=0.6), {}),
    "presence+frequency": (dict(presence_penalty=0.5, frequency_penalty=1.5, logit_bias=PUSH), dict(logit_bias=PUSH)),
    "negative frequency": (dict(frequency_penalty=-2.0), {}),
    "all": (dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                 logit_bias={13: 4.0, 30: 6.0}), {}),
}
ALL = ADJUSTED["all"][0]


@pytest.fixture(scope="module")
def tiny_loop(tiny_model_dir):
    return load_script("07_decode_loop").DecodeLoopEngine(str(tiny_model_dir), device="cpu")


# ---------------------------------------------------------------- the contract
@pytest.mark.parametrize("bad", [
    {"presence_penalty": 2.01}, {"frequency_penalty": -2.5}, {"presence_penalty": math.nan},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"repetition_penalty": 2.5},
    {"repetition_penalty": math.inf}, {"logit_bias": {5: 100.5}}, {"logit_bias": {5: math.nan}},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {True: 1.0}}, {"logit_bias": {"5": 1.0}},
    {"logit_bias": {5: "x"}}, {"logit_bias": ((5, 1.0), (5, 2.0))},
    {"logit_bias": {i: 1.0 for i in range(301)}}, {"logprobs": -1}, {"logprobs": 21},
])
def test_out_of_range_controls_are_value_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bounds_themselves_are_accepted_and_the_bias_is_normalised():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=2.0,
                       logit_bias={9: 100, 3: -100}, logprobs=20)
    assert p.logit_bias == ((3, -100.0), (9, 100.0)) and p.adjusts_logits
    assert not SamplingParams(logprobs=0).adjusts_logits
    hash(p)   # still a frozen, hashable value
    p.check_vocab(10)
    with pytest.raises(ValueError, match="vocabulary has 9 tokens"):
        p.check_vocab(9)


# ---------------------------------------------------------------- Chapter 1's functions
def test_each_adjustment_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_repetition_penalty(logits, seen, torch.tensor([[2.0]])).tolist() == [[1.0, -4.0, 1.0, 0.5]]
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    out = apply_presence_frequency(logits, counts, torch.tensor([[0.5]]), torch.tensor([[1.0]]))
    assert out.tolist() == [[-0.5, -2.0, -0.5, 0.5]]
    assert apply_logit_bias(logits, [((1, 3.0), (3, -0.5))]).tolist() == [[2.0, 1.0, 1.0, 0.0]]


def test_adjust_logits_is_per_row_and_leaves_plain_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(**ALL), SamplingParams(repetition_penalty=1.5)]
    histories = [None] + [TokenHistory([1, 2, 13], 50) for _ in range(2)]
    for token in (13, 13, 7):
        histories[1].add(token)
        histories[2].add(token)
    batched = adjust_logits(logits, params, histories)
    assert torch.equal(batched[0], logits[0])
    for row in (1, 2):
        alone = adjust_logits(logits[row:row + 1], params[row:row + 1], histories[row:row + 1])
        assert torch.equal(batched[row], alone[0])
    assert not torch.equal(batched[1], logits[1]) and not torch.equal(batched[2], logits[2])
    assert adjust_logits(logits, [SamplingParams()] * 3, [None] * 3) is logits   # nothing to do: no copy


def test_hf_processors_compute_the_same_numbers():
    """The baseline lets HF do the bias and the repetition penalty: same bits as ours."""
    torch.manual_seed(1)
    scores = torch.randn(1, 300) * 8
    ids = torch.tensor([[3, 17, 17, 250, 4]])
    seen = torch.zeros(1, 300, dtype=torch.bool)
    seen[0, ids[0]] = True
    for penalty in (0.3, 1.1, 1.3, 1.9):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores.clone())
        assert torch.equal(hf, apply_repetition_penalty(scores, seen, torch.tensor([[penalty]])))
    bias = ((3, 2.5), (99, -100.0))
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(ids, scores.clone())
    assert torch.equal(hf, apply_logit_bias(scores, [bias]))


def test_token_logprobs_are_the_models_distribution():
    torch.manual_seed(2)
    logits = torch.randn(2, 40)
    entries = token_logprobs(logits, [5, 9], [3, 0])
    expected = logits.log_softmax(-1)
    assert entries[0].token_id == 5 and entries[0].logprob == pytest.approx(float(expected[0, 5]))
    assert [t for t, _ in entries[0].top] == expected[0].topk(3).indices.tolist()
    assert entries[0].top[0][1] >= entries[0].top[1][1] >= entries[0].top[2][1]
    assert entries[1].top == ()


# ---------------------------------------------------------------- the engines agree
@pytest.mark.parametrize("name", sorted(ADJUSTED))
def test_greedy_with_adjustments_matches_baseline(name, tiny_engine, tiny_loop, reference_prompts):
    settings, without = ADJUSTED[name]
    params = SamplingParams(**settings)
    changed = 0
    for prompt in reference_prompts[:2]:
        base, ours = tiny_engine.generate(prompt, N_NEW, params), tiny_loop.generate(prompt, N_NEW, params)
        assert (ours.output_ids, ours.text, ours.finish_reason) == (base.output_ids, base.text, base.finish_reason)
        changed += base.output_ids != tiny_loop.generate(prompt, N_NEW, SamplingParams(**without)).output_ids
    assert changed, f"{name}: the adjustment changed no answer; is it applied at all?"


def test_seeded_sampling_with_adjustments_is_reproducible(tiny_loop, reference_prompts):
    params = SamplingParams(temperature=1.0, seed=11, **ALL)
    first = tiny_loop.generate(reference_prompts[0], N_NEW, params)
    assert tiny_loop.generate(reference_prompts[0], N_NEW, params).output_ids == first.output_ids


def test_logit_bias_forces_and_bans(tiny_engine, tiny_loop, reference_prompts):
    prompt = reference_prompts[0]
    plain = tiny_engine.generate(prompt, 4).output_ids
    banned = SamplingParams(logit_bias={plain[0]: -100})
    for engine in (tiny_engine, tiny_loop):
        assert engine.generate(prompt, 4, banned).output_ids[0] != plain[0]
        forced = engine.generate(prompt, 4, SamplingParams(logit_bias={30: 100}, temperature=1.0, seed=0))
        assert forced.output_ids == [30] * 4
        with pytest.raises(ValueError, match="vocabulary"):
            engine.generate(prompt, 4, SamplingParams(logit_bias={engine.vocab_size: 1}))


def test_a_request_carries_its_prompt_ids_into_the_penalties(tiny_loop):
    """Requests are built from their prompt ids, so a repetition penalty always sees the prompt;
    a request that adjusts nothing keeps no history at all."""
    r = tiny_loop.output.new_request([5, 6, 7], SamplingParams(repetition_penalty=1.2), 4)
    assert r.history.prompt_seen.nonzero().flatten().tolist() == [5, 6, 7]
    assert tiny_loop.output.new_request([5, 6, 7], SamplingParams(), 4).history is None
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_loop.output.new_request([5], SamplingParams(logit_bias={tiny_loop.vocab_size: 1.0}), 4)


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_match_baseline_and_describe_the_chosen_tokens(k, tiny_engine, tiny_loop, reference_prompts):
    params = SamplingParams(logprobs=k, **ALL)
    base = tiny_engine.generate(reference_prompts[1], N_NEW, params)
    ours = tiny_loop.generate(reference_prompts[1], N_NEW, params)
    assert ours.output_ids == base.output_ids
    assert [e.token_id for e in base.logprobs] == base.output_ids == [e.token_id for e in ours.logprobs]
    for a, b in zip(base.logprobs, ours.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.logprob <= 0
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == k
    assert tiny_loop.generate(reference_prompts[1], N_NEW).logprobs is None


@pytest.mark.parametrize("engine_name", ["tiny_engine", "tiny_loop"])
def test_streamed_pieces_carry_every_tokens_logprob_once(engine_name, request, reference_prompts):
    engine = request.getfixturevalue(engine_name)
    items = list(engine.generate_stream(reference_prompts[2], N_NEW, SamplingParams(logprobs=2, stop=["e"])))
    result, pieces = items[-1], items[:-1]
    carried = [e for p in pieces for e in getattr(p, "logprobs", ())]
    assert carried == result.logprobs[:len(carried)]          # in order, none twice
    assert len(result.logprobs) - len(carried) <= 1           # at most a textless last token (EOS) is left
    assert "".join(pieces) == result.text


def test_a_batch_samples_each_row_as_if_alone(tiny_loop):
    """The decode loop's sample(): different params per row, one pass, the same tokens as row by row."""
    torch.manual_seed(3)
    logits = torch.randn(3, tiny_loop.vocab_size)
    params = [SamplingParams(**ALL, logprobs=1), SamplingParams(), SamplingParams(frequency_penalty=2.0)]

    def fresh():
        requests = [tiny_loop.output.new_request([1, 2, 3], p, 8) for p in params]
        for r in requests:
            tiny_loop.output.accept(r, int(logits[0].argmax()), 0.0)
        return requests
    together = output.sample(logits, seqs := fresh())
    alone = [output.sample(logits[i:i + 1], [s])[0] for i, s in enumerate(fresh())]
    assert together == alone
    assert len(seqs[0].logprobs) == 1 and seqs[1].logprobs is None


@pytest.mark.parametrize("spec", ["10_model_engine:ModelEngine", "11_paged_kv_engine:PagedEngine",
                                  "12_prefix_cache_engine:PrefixCachingEngine",
                                  "minivllm:LLM"])
def test_engines_on_our_own_model_honour_every_control(spec, tiny_model_dir, tiny_engine, reference_prompts):
    """Chapters 6-9 sample through the same Request: penalties (repetition covers the prompt,
    so each engine must hand its prompt ids over) and bias give the baseline's tokens."""
    engine = load_engine(spec, str(tiny_model_dir), device="cpu")
    try:
        params = SamplingParams(**ALL)
        for prompt in reference_prompts[:2]:
            assert engine.generate(prompt, N_NEW, params).output_ids == tiny_engine.generate(prompt, N_NEW, params).output_ids
        batch = engine.generate_batch(reference_prompts[:3], N_NEW, params)
        assert [r.output_ids for r in batch] == [tiny_engine.generate(p, N_NEW, params).output_ids
                                                 for p in reference_prompts[:3]]
    finally:
        engine.close()


@pytest.mark.parametrize("engine_name", ["baseline", "decode_loop", "batching"])
def test_logprobs_end_where_the_text_ends_at_a_stop_string(tiny_model_dir, engine_name):
    """The stop string's own tokens stay in output_ids (they were generated) but not in logprobs,
    which describe the text returned: no entry past its end."""
    from conftest import load_script

    if engine_name == "baseline":
        engine = load_script("04_engine").BaselineEngine(str(tiny_model_dir), device="cpu")
    elif engine_name == "decode_loop":
        engine = load_script("07_decode_loop").DecodeLoopEngine(str(tiny_model_dir), device="cpu")
    else:
        engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20)
    try:
        free = engine.generate("Count: 1, 2, 3,", 24, SamplingParams(ignore_eos=True))
        stop = engine.tokenizer.decode(free.output_ids[8:11])
        assert stop.strip(), "the test needs a stop string with text in it"
        cut = engine.generate("Count: 1, 2, 3,", 24, SamplingParams(ignore_eos=True, stop=[stop], logprobs=1))
        spelled = engine.tokenizer.decode(cut.output_ids[:len(cut.logprobs)], skip_special_tokens=True)
        assert spelled.startswith(cut.text) and len(cut.logprobs) < len(cut.output_ids)
        shorter = engine.tokenizer.decode(cut.output_ids[:len(cut.logprobs) - 1], skip_special_tokens=True)
        assert len(shorter) < len(cut.text)     # one entry fewer would not cover the text
    finally:
        engine.close()


def test_a_batch_draws_each_row_by_its_seed_and_position_alone():
    """The engine's sampler races every sampled row of a step at once; each row's token is the
    one its seed and output position give (speculative decoding's draw), whoever shares the step."""
    from types import SimpleNamespace

    import torch

    from minivllm import sampling as lib_sampling
    from minivllm.contracts import SamplingParams as Params
    from minivllm.output import sample
    from minivllm.speculative import draw

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    params = [Params(temperature=0.8, seed=1), Params(), Params(temperature=1.2, top_k=20, seed=2),
              Params(temperature=0.7, top_p=0.9, seed=3), Params(temperature=1.0, top_k=5, top_p=0.5, seed=4),
              Params(temperature=0.5, seed=5)]

    def requests(order):
        return [SimpleNamespace(params=params[i], seed=params[i].seed or 0, choice=0, new_ids=[7] * step, held_back=(), history=None,
                                constraint=None, finish_reason=None, logprobs=None) for i in order]

    for step in range(3):
        alone = [sample(logits[i:i + 1], requests([i]))[0] for i in range(6)]
        assert sample(logits, requests(range(6))) == alone
        backwards = list(reversed(range(6)))
        assert sample(logits[backwards], requests(backwards)) == alone[::-1]
        for i, p in enumerate(params):
            want = int(logits[i].argmax()) if p.is_greedy else draw(lib_sampling.probabilities(logits[i], p),
                                                                    p.seed, step)
            assert alone[i] == want
