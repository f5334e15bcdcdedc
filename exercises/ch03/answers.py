"""Chapter 3 exercises: the KV cache (08_kv_cache.py, 08_kv_cache_sizes.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch03
# (the shipped solutions are in solutions/answers.py: try first)

from minivllm.roofline import kv_bytes_per_token


# Exercise 3.1 (predict, then measure). The tests' tiny model (tests/conftest.py: 2 layers,
# hidden 64, 4 query heads, 2 KV heads, float32): how many bytes does its KV cache hold per
# token after a prefill? Measured with 08_kv_cache_sizes.measured_cache_bytes. Tolerance: exact.
TINY_KV_BYTES_PER_TOKEN = None


# Exercise 3.2 (predict, then count). SmolLM2-135M, the decode step that makes token 201: how
# many times more FLOPs without the cache than with it (08_kv_cache.step_flops)? Tolerance: 10 %.
FLOPS_RATIO_AT_200 = None


def sliding_window_kv_bytes(config, tokens: int, dtype, window: int | None) -> int:
    """Exercise 3.3 (extend): the KV cache of one sequence of `tokens` tokens when each layer
    keeps only the last `window` tokens (sliding-window attention, as Mistral 7B's 4096);
    window None: the full cache. Checked exactly against the book's per-token formula."""
    raise NotImplementedError
