"""Chapter 12 exercises: quantised weights (minivllm/quantization.py) (solutions)."""

import torch


# Exercise 12.1 (predict, then measure). A [128, 256] float32 layer as Int4Weight(w, 32), the fast
# path: how many bytes does it hold (.nbytes)? Tolerance: exact.
# why: 128 x 256 codes of 4 bits = 16 384 bytes; per group of 32 inputs a bf16 scale and a bf16
# zero: 128 x 8 groups x 2 x 2 bytes = 4 096.
INT4_BYTES = 128 * 256 // 2 + 128 * (256 // 32) * 2 * 2


# Exercise 12.2 (predict, then measure). A row of 4096 random weights whose largest magnitude is
# 1.27, quantised per channel to int8 and back: the largest absolute error. Tolerance: 10 %.
# why: the scale is 1.27 / 127 = 0.01; rounding is off by at most half a step, and with 4096
# weights some land close to that.
INT8_MAX_ERROR = 0.01 / 2


def quantize_int4_symmetric(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 12.3 (extend): int4 without a zero point: per group, scale = max|w| / 7 and codes
    round(w / scale) in -8..7 (int8 tensor), w ~ q * scale. Returns (q [n, k], scale [n, k/group]).
    Checked: codes in range, error at most half a step, worse than the asymmetric format on
    all-positive weights."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-8)
    q = torch.round(groups / scale[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(n, k), scale


def check_int4_round_trip(quantize, dequantize) -> None:
    """Exercise 12.4 (find the bug): raise AssertionError if quantize_int4 then dequantize_int4
    (group 32) misses any weight by more than half a step of its group. Called with the real
    pair and with a defect planted in one of them."""
    torch.manual_seed(0)
    w = torch.randn(16, 128) + 0.5
    q, scale, zero = quantize(w, 32)
    err = (dequantize(q, scale, zero) - w).abs().reshape(16, 4, 32).amax(-1)
    assert torch.all(err <= scale.float() * 0.5 + 1e-2), f"worst error {err.max():.3g}"
