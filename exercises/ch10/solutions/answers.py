"""Chapter 10 exercises: speculative decoding (minivllm/speculative.py) (solutions)."""



# Exercise 10.1 (predict, then measure). The n-gram proposer (NgramProposer(), n-grams of 4 down
# to 2) looks at tokens [5, 6, 7, 8, 9, 5, 6] and guesses k = 3 tokens: which? Tolerance: exact.
# why: no earlier [8, 9, 5, 6] nor [9, 5, 6]; the suffix [5, 6] occurred at the start, followed by 7, 8, 9.
NGRAM_GUESS = [7, 8, 9]


# Exercise 10.2 (predict, then measure). Speculation with a draft model that is the target
# itself (speculative="draft", draft_model = the same folder, no quantisation), greedy: what
# share of the guesses is accepted (accepted_tokens / draft_tokens)? Tolerance: exact.
# why: the same weights give the same argmax at every position: every guess is right.
ACCEPTANCE_SAME_MODEL = 1.0


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Exercise 10.3 (extend): each of k guesses is accepted with probability alpha, independently,
    until the first rejection; a round always yields one token of the target's own besides the
    accepted guesses. The expected tokens per round; checked against a simulation of 200 000
    rounds, within 2 %."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0


def check_speculation_is_exact(plain_ids, speculated_ids) -> None:
    """Exercise 10.4 (find the bug): raise AssertionError unless greedy speculation changed nothing.
    Called with the token ids of a plain engine and of a speculating one, for the same prompts;
    once with the real acceptance rule, once with a defect planted in it."""
    assert plain_ids == speculated_ids, f"speculation changed the output: {plain_ids} != {speculated_ids}"
