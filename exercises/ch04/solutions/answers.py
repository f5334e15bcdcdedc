"""Chapter 4 exercises: the roofline (08_roofline.py) (solutions)."""

import dataclasses


# Exercise 4.1 (predict, then count). SmolLM2-135M in float32, one decode step, batch 1,
# 512 cached tokens: its arithmetic intensity in FLOP/byte (08_roofline.decode_step_cost).
# Tolerance: 20 %.
# why: each float32 weight (4 bytes) is read once for one multiply-add (2 FLOPs): 0.5 FLOP/byte,
# a little less because the cached keys and values are read too.
DECODE_INTENSITY_BATCH_1 = 0.5


# Exercise 4.2 (predict, then count). A machine of 100 GB/s and 500 GFLOP/s (float32), SmolLM2,
# 512 cached tokens: the smallest decode batch that reaches the ridge (08_roofline.bend_batch).
# Tolerance: 30 %.
# why: the ridge is 5 FLOP/byte. A sequence's step costs about 2 x 135 M + attention = 304 MFLOP
# and reads its own 513 x 46 KB = 23.6 MB of KV; the 538 MB of weights are shared. So
# 304 B / (538 + 23.6 B) = 5 gives B = 14.5: the KV reads, not the weights, set the bend.
BEND_BATCH = 15


def with_weight_bytes(cost, bytes_per_weight: float, dtype_bytes: int = 4):
    """Exercise 4.3 (extend): the same step with weights stored in `bytes_per_weight` bytes
    (1 for int8, 0.5 for int4) instead of `dtype_bytes`: a StepCost whose weight bytes shrink,
    FLOPs and KV bytes unchanged. Checked exactly, and on the intensity it implies."""
    return dataclasses.replace(cost, weight_bytes=cost.weight_bytes * bytes_per_weight / dtype_bytes)
