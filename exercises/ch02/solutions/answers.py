"""Chapter 2 exercises: the decode loop (07_decode_loop.py) (solutions)."""


# Exercise 2.1 (predict, then measure). DecodeLoopEngine.generate with max_new_tokens=10 and
# ignore_eos=True: how many times does it call decode_step? Tolerance: exact.
# why: the prefill's logits give token 1; each decode step gives one more: 9 for tokens 2..10.
DECODE_STEPS_FOR_10_TOKENS = 9


def cached_tokens_after(n_prompt: int, new_tokens: int) -> int:
    """Exercise 2.2 (predict, then measure): how many tokens the KV cache holds after the last
    decode step of a greedy request of `new_tokens` tokens on an `n_prompt`-token prompt.
    Checked exactly, on three prompt lengths."""
    # why: the last sampled token is returned, never fed back, so it never enters the cache.
    return n_prompt + new_tokens - 1


def check_timings(result) -> None:
    """Exercise 2.3 (find the bug): raise AssertionError if this GenerateResult of 8 tokens has
    timings that cannot be right. Called on a result from the real engine and on one from an
    engine with a defect planted in how it records when tokens were ready."""
    m = result.metrics
    assert m.output_tokens == 8
    assert m.tpot_ms is not None and m.tpot_ms > 0, f"8 tokens but no time between them: {m}"
    assert m.ttft_ms < m.ttft_ms + 7 * m.tpot_ms
