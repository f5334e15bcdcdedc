"""Chapter 3 exercises: the KV cache (08_kv_cache.py, 08_kv_cache_sizes.py) (solutions)."""

from minivllm.roofline import kv_bytes_per_token


# Exercise 3.1 (predict, then measure). The tests' tiny model (tests/conftest.py: 2 layers,
# hidden 64, 4 query heads, 2 KV heads, float32): how many bytes does its KV cache hold per
# token after a prefill? Measured with 08_kv_cache_sizes.measured_cache_bytes. Tolerance: exact.
# why: 2 (K and V) x 2 layers x 2 KV heads x head_dim 16 (64 / 4) x 4 bytes.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


# Exercise 3.2 (predict, then count). SmolLM2-135M, the decode step that makes token 201: how
# many times more FLOPs without the cache than with it (08_kv_cache.step_flops)? Tolerance: 10 %.
# why: without the cache the step pushes all 200 tokens through the layers' matmuls (about 106 M
# weights per token), with it one token; but the LM head (49152 x 576 = 28 M) runs for the last
# position only, either way: (200 x 106 + 28) / (106 + 28) is about 158.
FLOPS_RATIO_AT_200 = 158


def sliding_window_kv_bytes(config, tokens: int, dtype, window: int | None) -> int:
    """Exercise 3.3 (extend): the KV cache of one sequence of `tokens` tokens when each layer
    keeps only the last `window` tokens (sliding-window attention, as Mistral 7B's 4096);
    window None: the full cache. Checked exactly against the book's per-token formula."""
    kept = tokens if window is None else min(tokens, window)
    return kept * kv_bytes_per_token(config, dtype)
