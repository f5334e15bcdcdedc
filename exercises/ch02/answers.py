"""Chapter 2 exercises: the decode loop (07_decode_loop.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch02
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 2.1 (predict, then measure). DecodeLoopEngine.generate with max_new_tokens=10 and
# ignore_eos=True: how many times does it call decode_step? Tolerance: exact.
DECODE_STEPS_FOR_10_TOKENS = None


def cached_tokens_after(n_prompt: int, new_tokens: int) -> int:
    """Exercise 2.2 (predict, then measure): how many tokens the KV cache holds after the last
    decode step of a greedy request of `new_tokens` tokens on an `n_prompt`-token prompt.
    Checked exactly, on three prompt lengths."""
    raise NotImplementedError


def check_timings(result) -> None:
    """Exercise 2.3 (find the bug): raise AssertionError if this GenerateResult of 8 tokens has
    timings that cannot be right. Called on a result from the real engine and on one from an
    engine with a defect planted in how it records when tokens were ready."""
    raise NotImplementedError
