"""02_sampling.py: the properties each sampling function promises."""

import pytest
import torch

from minivllm.contracts import MIN_TEMPERATURE, SamplingParams
from minivllm.sampling import apply_temperature, greedy, make_generator, sample_next_token, top_k_filter, top_p_filter


@pytest.fixture
def logits():
    return torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax(logits):
    assert int(greedy(logits)) == int(torch.argmax(logits))
    batch = torch.stack([logits, -logits])
    assert greedy(batch).tolist() == [int(logits.argmax()), int((-logits).argmax())]


@pytest.mark.parametrize("k", [1, 5, 50])
def test_top_k_keeps_exactly_the_k_largest(logits, k):
    filtered = top_k_filter(logits, k)
    kept = torch.isfinite(filtered).nonzero().flatten()
    assert set(kept.tolist()) == set(torch.topk(logits, k).indices.tolist())
    assert torch.equal(filtered[kept], logits[kept])  # survivors keep their scores


def test_top_k_zero_or_huge_is_a_no_op(logits):
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 5000), logits)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(logits, p):
    probs = logits.softmax(-1)
    kept = torch.isfinite(top_p_filter(logits, p))
    n = int(kept.sum())
    ranked = torch.sort(probs, descending=True)
    assert set(kept.nonzero().flatten().tolist()) == set(ranked.indices[:n].tolist())  # the most likely ones
    assert float(ranked.values[:n].sum()) >= p - 1e-6          # they reach p ...
    assert float(ranked.values[: n - 1].sum()) < p             # ... and one fewer would not


def test_top_p_always_keeps_the_top_token():
    peaked = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert torch.isfinite(top_p_filter(peaked, 0.01)).tolist() == [True, False, False, False]
    assert torch.equal(top_p_filter(peaked, 1.0), peaked)
    # A p below float32's range (rounded to 0 against float32 probabilities) keeps it too.
    flat = torch.zeros(4)
    assert torch.isfinite(top_p_filter(flat, 1e-300)).sum() == 1


def test_the_smallest_settings_still_sample_a_token(logits):
    """At the edges of SamplingParams' ranges the probabilities stay finite: a token comes out."""
    edges = [SamplingParams(temperature=MIN_TEMPERATURE), SamplingParams(temperature=1.0, top_p=1e-300)]
    for params in edges:
        assert sample_next_token(logits, params, make_generator(0)) == int(logits.argmax())


def test_top_p_works_row_wise_on_a_batch(logits):
    batch = torch.stack([logits, logits.flip(0)])
    out = top_p_filter(batch, 0.5)
    assert torch.equal(out[0], top_p_filter(logits, 0.5))
    assert torch.equal(out[1], top_p_filter(logits.flip(0), 0.5))


def test_temperature_towards_zero_becomes_argmax(logits):
    probs = apply_temperature(logits, 1e-3).softmax(-1)
    assert int(probs.argmax()) == int(logits.argmax()) and float(probs.max()) > 0.999
    params = SamplingParams(temperature=1e-3, seed=1)
    draws = {sample_next_token(logits, params, make_generator(s)) for s in range(20)}
    assert draws == {int(logits.argmax())}


def test_temperature_flattens_and_sharpens(logits):
    entropy = lambda t: float(-(t.softmax(-1) * t.log_softmax(-1)).sum())  # noqa: E731
    assert entropy(apply_temperature(logits, 2.0)) > entropy(logits)
    assert entropy(apply_temperature(logits, 0.5)) < entropy(logits)
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, 0.0)


def test_sample_next_token_greedy_and_seeded(logits):
    assert sample_next_token(logits, SamplingParams()) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=42)
    first = [sample_next_token(logits, params, make_generator(42)) for _ in range(5)]
    assert len(set(first)) == 1  # same seed, same draw
    stream = make_generator(42)
    draws = [sample_next_token(logits, params, stream) for _ in range(200)]
    allowed = set(torch.isfinite(top_p_filter(top_k_filter(logits, 20), 0.9))
                  .nonzero().flatten().tolist())
    assert set(draws) <= allowed and len(set(draws)) > 1


def test_make_generator_without_seed_is_none():
    assert make_generator(None) is None
