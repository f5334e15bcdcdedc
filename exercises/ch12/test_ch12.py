"""Chapter 12's exercises, on the real quantisation functions."""

import torch

from harness import catches, patched, within
from minivllm import quantization as qz


def test_12_1_int4_bytes(answers):
    within(answers.INT4_BYTES, qz.Int4Weight(torch.randn(128, 256), 32).nbytes, what="INT4_BYTES")


def test_12_2_int8_error(answers):
    torch.manual_seed(0)
    w = torch.rand(1, 4096) * 2.54 - 1.27
    w[0, 0] = 1.27
    q, scale = qz.quantize_int8(w)
    within(answers.INT8_MAX_ERROR, float((qz.dequantize_int8(q, scale) - w).abs().max()), rel=0.1,
           what="INT8_MAX_ERROR")


def test_12_3_symmetric(answers):
    torch.manual_seed(0)
    w = torch.randn(8, 128)
    q, scale = answers.quantize_int4_symmetric(w, 32)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (8, 4)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    back = (q.reshape(8, 4, 32).float() * scale[..., None]).reshape(8, 128)
    assert torch.all((back - w).abs().reshape(8, 4, 32).amax(-1) <= scale * 0.5 + 1e-6)
    positive = torch.rand(8, 128)
    qs, ss = answers.quantize_int4_symmetric(positive, 32)
    sym = ((qs.reshape(8, 4, 32).float() * ss[..., None]).reshape(8, 128) - positive).abs().mean()
    asym = (qz.dequantize_int4(*qz.quantize_int4(positive, 32)) - positive).abs().mean()
    assert sym > asym, "all-positive weights waste half of the symmetric codes"


# --- the planted defect (read it after you have tried) ---------------------------------------
def zero_point_dropped(original):
    return lambda q, scale, zero: original(q, scale, torch.zeros_like(zero))


def test_12_4_find_the_bug(answers):
    catches(lambda pair: answers.check_int4_round_trip(*pair),
            lambda: patched("minivllm.quantization:dequantize_int4", zero_point_dropped),
            lambda: (qz.quantize_int4, qz.dequantize_int4), what="check_int4_round_trip")
