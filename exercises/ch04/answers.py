"""Chapter 4 exercises: the roofline (08_roofline.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch04
# (the shipped solutions are in solutions/answers.py: try first)

import dataclasses


# Exercise 4.1 (predict, then count). SmolLM2-135M in float32, one decode step, batch 1,
# 512 cached tokens: its arithmetic intensity in FLOP/byte (08_roofline.decode_step_cost).
# Tolerance: 20 %.
DECODE_INTENSITY_BATCH_1 = None


# Exercise 4.2 (predict, then count). A machine of 100 GB/s and 500 GFLOP/s (float32), SmolLM2,
# 512 cached tokens: the smallest decode batch that reaches the ridge (08_roofline.bend_batch).
# Tolerance: 30 %.
BEND_BATCH = None


def with_weight_bytes(cost, bytes_per_weight: float, dtype_bytes: int = 4):
    """Exercise 4.3 (extend): the same step with weights stored in `bytes_per_weight` bytes
    (1 for int8, 0.5 for int4) instead of `dtype_bytes`: a StepCost whose weight bytes shrink,
    FLOPs and KV bytes unchanged. Checked exactly, and on the intensity it implies."""
    raise NotImplementedError
