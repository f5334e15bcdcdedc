"""Chapter 10's exercises, on the n-gram proposer and the speculating LLM over the tiny model."""

import random

import pytest

from harness import catches, patched, within
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.speculative import NgramProposer

GREEDY = SamplingParams(ignore_eos=True)
PROMPTS = ["one two one two one two", "The capital of France is"]


def test_10_1_ngram(answers):
    assert answers.NGRAM_GUESS is not None, "NGRAM_GUESS is still None: write your answer in answers.py first"
    assert answers.NGRAM_GUESS == NgramProposer().lookup([5, 6, 7, 8, 9, 5, 6], 3)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20) as llm:
        return [r.output_ids for r in llm.generate(PROMPTS, 16, GREEDY)]


def speculated(folder, draft_model=None):
    """Speculation with a draft model: `draft_model`, or by default the target's own int4 copy."""
    extra = {"draft_model": str(draft_model)} if draft_model else {}
    with LLM(str(folder), device="cpu", kv_memory=1 << 20, speculative="draft", num_speculative_tokens=3,
             **extra) as llm:
        return llm.generate(PROMPTS, 16, GREEDY)


def test_10_2_acceptance(answers, tiny_model_dir):
    results = speculated(tiny_model_dir, tiny_model_dir)
    drafted = sum(r.metrics.draft_tokens or 0 for r in results)
    assert drafted > 0
    within(answers.ACCEPTANCE_SAME_MODEL, sum(r.metrics.accepted_tokens for r in results) / drafted,
           what="ACCEPTANCE_SAME_MODEL")


def test_10_3_expected_tokens(answers):
    rng = random.Random(0)
    for alpha, k in ((0.5, 4), (0.8, 3), (0.0, 5), (0.95, 8)):
        rounds, total = 200_000, 0
        for _ in range(rounds):
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            total += n + 1
        within(answers.expected_tokens_per_round(alpha, k), total / rounds, rel=0.02,
               what=f"expected_tokens_per_round({alpha}, {k})")


# --- the planted defect (read it after you have tried) ---------------------------------------
def one_guess_too_many(original):
    def accept(logits, r):
        kept, n = original(logits, r)
        if n < len(r.draft_ids):             # keep the first rejected guess as if it were right
            kept = kept[:-1] + [r.draft_ids[n]] + kept[-1:]
            n += 1
        return kept, n
    return accept


def test_10_4_find_the_bug(answers, plain, tiny_model_dir):
    catches(lambda ids: answers.check_speculation_is_exact(plain, ids),
            lambda: patched("minivllm.speculative:accept_guesses", one_guess_too_many),
            lambda: [r.output_ids for r in speculated(tiny_model_dir)], what="check_speculation_is_exact")
