"""The engine's one sampler (Chapters 2, 10 and 15): every drawn token is the Gumbel-max race over
noise keyed on (seed, choice, position), in one batched operation with no torch.multinomial."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm import LLM, sampling
from minivllm.contracts import SamplingParams
from minivllm.output import sample
from minivllm.speculative import NgramProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4      # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32


def rows(params: list[SamplingParams], seeds: list[int], position: int = 0):
    return [SimpleNamespace(params=p, seed=s, choice=0, new_ids=[0] * position, held_back=(), history=None, constraint=None,
                            finish_reason=None, logprobs=None) for p, s in zip(params, seeds)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_the_race_draws_from_the_same_distribution_as_chapter_1s_sampler(params):
    """4,800 draws (600 seeds x 8 positions, batched 600 rows a step): the counts fit the
    distribution Chapter 1's probabilities() gives (chi-squared, p < 0.001 would fail), and
    top-k / top-p's cut tokens never appear."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, -3.0])
    p = sampling.probabilities(logits, params)
    seeds, counts = list(range(600)), torch.zeros(8)
    for position in range(8):
        tokens = sample(logits.expand(len(seeds), -1), rows([params] * len(seeds), seeds, position))
        counts += torch.bincount(torch.tensor(tokens), minlength=8)
    assert counts[p == 0].sum() == 0
    support = p > 0
    expected = counts.sum() * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    critical = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[int(support.sum()) - 1]   # p = 0.001
    assert chi2 < critical, (counts.tolist(), expected.tolist())


def test_the_noise_is_one_integer_hash_the_same_on_every_device():
    """The tensor hash equals the same steps on Python integers (what any device computes), the
    noise depends on seed, choice and position, and u stays strictly inside (0, 1)."""
    vocab = 1000
    keys = [sampling.noise_key(seed, choice, pos) for seed, choice, pos in
            [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (2 ** 62 + 5, 3, 70_000)]]
    assert len(set(keys)) == len(keys) and all(0 <= k < 2 ** 32 for k in keys)
    noise = sampling.gumbel_noise(keys, vocab, "cpu")
    for row, key in enumerate(keys):
        for token in (0, 1, 517, vocab - 1):
            word = sampling.mix32(sampling.mix32(sampling.mix32(token)) ^ key)
            u = ((word >> 8) + 0.5) * 2.0 ** -24
            assert 0 < u < 1
            assert noise[row, token].item() == pytest.approx(-torch.tensor(u).log().neg().log().item(), abs=1e-5)
    assert torch.equal(noise, sampling.gumbel_noise(keys, vocab, "cpu"))      # the same key, the same noise
    assert not torch.equal(noise[0], noise[1])


def test_no_step_calls_multinomial_and_seeded_answers_ignore_batch_mates(tiny_model_dir, monkeypatch):
    """Sampled requests through the assembled engine: torch.multinomial is never called, and a
    seeded request's answer is the same alone, among others, and with n-gram speculation."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.multinomial called: the engine draws by the race")

    monkeypatch.setattr(torch, "multinomial", refuse)
    options = dict(device="cpu", kv_memory=2048 * TINY_KV_BYTES_PER_TOKEN, block_size=8, max_num_seqs=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    prompts = ["The sea, the sea, the sea", "One two three", "Hello there", "a b a b a b", "Summer", "Why?"]
    plain = LLM(str(tiny_model_dir), **options)
    try:
        alone = plain.generate_batch(prompts[:1], 16, seeded)[0].output_ids
        mixed = [plain.submit(p, 16, params) for p, params in zip(prompts, [seeded] + others)]
        assert mixed[0].result().output_ids == alone
        for stream in mixed[1:]:
            stream.result()
    finally:
        plain.close()
    speculating = LLM(str(tiny_model_dir), speculative="ngram", num_speculative_tokens=3, **options)
    try:
        assert isinstance(speculating.speculator.proposer, NgramProposer)
        assert speculating.generate_batch(prompts[:1], 16, seeded)[0].output_ids == alone
    finally:
        speculating.close()

