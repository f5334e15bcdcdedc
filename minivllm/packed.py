"""Chapter 13: packed weights. Each matrix handed to oneDNN once, at load, in the blocked
layout its kernel reads, so that a matmul of a few rows stops repacking it on every call.
`minivllm/compile.py` builds the compiled model on these."""

from __future__ import annotations

import torch

from minivllm.model import LlamaModel
from minivllm.quantization import HalfWeight
from minivllm.weights import map_weights


# --8<-- [start:packed]
class PackedWeight:
    """A float32 or bf16 matrix in oneDNN's blocked layout, packed once: x @ Wᵀ without the
    per-call repacking a plain GEMM does. bf16 runs on AVX-512 bf16 units where the CPU has them."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype):
        self.dtype, self.shape = dtype, tuple(w.shape)
        # the batch size is a hint for the blocking; any number of rows works afterwards
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous(), 32)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, None, "none", [], "")
        return out.to(x.dtype)


def can_pack(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def packed_weights(model: LlamaModel) -> dict:
    """Every matrix a matmul reads, packed where oneDNN has a kernel for its format: float32
    tensors and bf16 HalfWeights. int8 and int4 keep Chapter 12's packed kernels; the embedding
    table stays a table (a tied LM head gets its own packed copy). Packing reaches inside
    wrappers: a tensor-parallel shard (Chapter 14) packs its own slice."""
    if not can_pack(model.device):
        return dict(model.w)

    def pack(name: str, weight):
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32:
            return PackedWeight(weight, torch.float32)
        if isinstance(weight, HalfWeight) and weight.w.dtype == torch.bfloat16 and weight.path == "fast":
            return PackedWeight(weight.w, torch.bfloat16)
        return weight

    return map_weights(model, pack, [name for name in model.w if name != "embed"])
# --8<-- [end:packed]
