"""Chapter 5 exercises: static batching (09_static_batching.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch05
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 5.1 (predict, then measure). Four prompts of 10, 20, 30 and 40 tokens, left-padded
# into one batch: what share of the prefill's positions is padding (09_static_batching.padding_waste)?
# Tolerance: 0.01.
PREFILL_PADDING_SHARE = None


# Exercise 5.2 (predict, then measure). Two prompts of 10 and 40 tokens, 11 new tokens each:
# what share of the keys read during the decode steps are padding? Tolerance: 0.02.
DECODE_PADDING_SHARE = None


def check_batching(engine) -> None:
    """Exercise 5.3 (find the bug): raise AssertionError if this StaticBatchEngine's batched
    greedy answers differ from its one-at-a-time answers. Called on the real engine and on one
    with a defect planted in how a batch is laid out."""
    raise NotImplementedError
