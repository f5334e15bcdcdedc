"""Chapter 12 exercises: quantised weights (minivllm/quantization.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch12
# (the shipped solutions are in solutions/answers.py: try first)

import torch


# Exercise 12.1 (predict, then measure). A [128, 256] float32 layer as Int4Weight(w, 32), the fast
# path: how many bytes does it hold (.nbytes)? Tolerance: exact.
INT4_BYTES = None


# Exercise 12.2 (predict, then measure). A row of 4096 random weights whose largest magnitude is
# 1.27, quantised per channel to int8 and back: the largest absolute error. Tolerance: 10 %.
INT8_MAX_ERROR = None


def quantize_int4_symmetric(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 12.3 (extend): int4 without a zero point: per group, scale = max|w| / 7 and codes
    round(w / scale) in -8..7 (int8 tensor), w ~ q * scale. Returns (q [n, k], scale [n, k/group]).
    Checked: codes in range, error at most half a step, worse than the asymmetric format on
    all-positive weights."""
    raise NotImplementedError


def check_int4_round_trip(quantize, dequantize) -> None:
    """Exercise 12.4 (find the bug): raise AssertionError if quantize_int4 then dequantize_int4
    (group 32) misses any weight by more than half a step of its group. Called with the real
    pair and with a defect planted in one of them."""
    raise NotImplementedError
