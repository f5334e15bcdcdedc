"""Chapters 3 and 4: what a forward costs, counted from a model's config, and the machine's two limits.

Chapter 3 counts the work of a forward (two FLOPs per weight for every new token, plus
attention over the keys it reads) and prices the KV cache in bytes per token; Chapter 4 adds
the weights' bytes and measures the two limits a step runs into, memory bandwidth and matmul
speed. The counts read a config by Hugging Face's attribute names (`num_hidden_layers`,
`num_key_value_heads`, ...), so an HF config, a config.json read as such, or a published
table such as `LLAMA3_8B` all serve; no weights are needed. `08_kv_cache.py`,
`08_kv_cache_sizes.py` and `08_roofline.py` show them at work; later chapters measure
against them.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


# --8<-- [start:work]
def layer_matmul_weights(config) -> int:
    """The weights of one layer's matrices: Q, K, V and output projections, and the MLP's three."""
    d, heads, hidden = head_dim(config), config.num_attention_heads, config.hidden_size
    return hidden * (heads + 2 * num_kv_heads(config)) * d + heads * d * hidden + 3 * hidden * config.intermediate_size


def weight_flops(config, new_tokens: int, logits: int = 1) -> int:
    """FLOPs of the weight matmuls: every new token meets every matrix of every layer once
    (a multiply and an add per weight), and `logits` rows go through the LM head."""
    return 2 * (new_tokens * config.num_hidden_layers * layer_matmul_weights(config)
                + logits * config.hidden_size * config.vocab_size)


def attention_flops(config, new_tokens: int, cached: int) -> int:
    """FLOPs of attention itself: new token i scores and mixes cached + i + 1 keys and values
    in every query head (QK^T, then the weighted sum of V: head_dim multiply-adds each)."""
    keys_seen = new_tokens * cached + new_tokens * (new_tokens + 1) // 2   # causal: token i sees i + 1
    return 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * keys_seen


def forward_flops(config, new_tokens: int, cached: int, logits: int = 1) -> int:
    """One forward over `new_tokens` tokens after `cached` tokens already in the cache."""
    return weight_flops(config, new_tokens, logits) + attention_flops(config, new_tokens, cached)
# --8<-- [end:work]


# --8<-- [start:size-formula]
def kv_bytes_per_token(config, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """K and V, for every layer, for every KV head, head_dim numbers each, at dtype's width."""
    if kv_heads is None:
        kv_heads = num_kv_heads(config)
    bytes_per_element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim(config) * bytes_per_element
# --8<-- [end:size-formula]


def weight_bytes(config, dtype: torch.dtype) -> int:
    """The weights' bytes from the config: embedding (and LM head unless tied), and per layer the
    attention projections, the MLP and two norms; the 1-D norms are negligible but counted."""
    h = config.hidden_size
    per_layer = layer_matmul_weights(config) + 2 * h
    embed = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return (config.num_hidden_layers * per_layer + embed + h) * torch.empty((), dtype=dtype).element_size()


# --8<-- [start:llama3]
# Published configs (the config.json of meta-llama/Meta-Llama-3-8B and Meta-Llama-3-70B on the
# Hugging Face Hub; also Table 3 of "The Llama 3 Herd of Models", 2024). Written out here so
# nothing is downloaded: only the fields the arithmetic reads.
LLAMA3_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 hidden_size=4096, intermediate_size=14336, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192)
LLAMA3_70B = dict(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                  hidden_size=8192, intermediate_size=28672, vocab_size=128256,
                  tie_word_embeddings=False, max_position_embeddings=8192)
# --8<-- [end:llama3]


def as_config(fields: dict) -> SimpleNamespace:
    """A config-like object from a dict, read through the same attribute names as an HF config."""
    return SimpleNamespace(**fields)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def best_time(fn, device: torch.device, repeats: int, label: str = "") -> float:
    """The fastest of `repeats` runs of fn(), in seconds: a busy machine only ever adds time.
    With a label, one plain line on stderr says what was measured (stdout stays the result)."""
    fn()                                   # warm-up: first calls allocate and fault pages in
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    if label:
        print(f"[measure] {label}: best of {repeats} tries {best * 1e3:.2f} ms", file=sys.stderr, flush=True)
    return best


# --8<-- [start:limits]
def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5, label: str = "") -> float:
    """Memory read bandwidth in bytes/s: one sum over a float32 tensor far larger than any cache."""
    big = torch.ones(max(1, nbytes // 4), device=device)
    return big.numel() * 4 / best_time(big.sum, device, repeats, label)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048,
                        repeats: int = 5, label: str = "") -> float:
    """Matmul speed in FLOP/s: one n x n x n GEMM (2 n^3 FLOPs), big enough to keep every unit busy."""
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b, device, repeats, label)
# --8<-- [end:limits]
