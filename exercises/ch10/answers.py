"""Chapter 10 exercises: speculative decoding (minivllm/speculative.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch10
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 10.1 (predict, then measure). The n-gram proposer (NgramProposer(), n-grams of 4 down
# to 2) looks at tokens [5, 6, 7, 8, 9, 5, 6] and guesses k = 3 tokens: which? Tolerance: exact.
NGRAM_GUESS = None


# Exercise 10.2 (predict, then measure). Speculation with a draft model that is the target
# itself (speculative="draft", draft_model = the same folder, no quantisation), greedy: what
# share of the guesses is accepted (accepted_tokens / draft_tokens)? Tolerance: exact.
ACCEPTANCE_SAME_MODEL = None


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Exercise 10.3 (extend): each of k guesses is accepted with probability alpha, independently,
    until the first rejection; a round always yields one token of the target's own besides the
    accepted guesses. The expected tokens per round; checked against a simulation of 200 000
    rounds, within 2 %."""
    raise NotImplementedError


def check_speculation_is_exact(plain_ids, speculated_ids) -> None:
    """Exercise 10.4 (find the bug): raise AssertionError unless greedy speculation changed nothing.
    Called with the token ids of a plain engine and of a speculating one, for the same prompts;
    once with the real acceptance rule, once with a defect planted in it."""
    raise NotImplementedError
