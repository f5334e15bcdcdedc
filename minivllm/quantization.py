"""Chapter 12: fewer bytes per weight, because decode reads every one.

At batch 1 a decode step multiplies one vector by every weight matrix once: the arithmetic is
tiny, reading the weights is not. So weights are stored in fewer bytes (bf16, int8 with a scale
per output channel, int4 with a scale and zero per group), and each format keeps two ways to
multiply: a *reference* path that dequantises and runs an ordinary matmul, and a *fast* path
that hands the packed integers to torch's kernels. A quantised weight is a linear operation
(Chapter 6's `matmul`), so the model, the runner and the engine never change.
"""

from __future__ import annotations

import torch

from minivllm.config import GROUP_SIZES, HEAD_FORMATS, QUANT_FORMATS
from minivllm.model import LlamaModel
from minivllm.weights import map_weights

MODES = ("none", *QUANT_FORMATS)        # "none": the model's own weights, as the demo's baseline
LINEAR_LAYERS = ("qkv", "o", "gate_up", "down")
KERNEL_DTYPE = torch.bfloat16           # the activations the packed kernels read and write


# --8<-- [start:int8]
def quantize_int8(w: torch.Tensor, row_max=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric, one scale per output channel: w[n, k] ~ q[n, k] * scale[n], q in -127..127
    (an int8 also holds -128, left unused so that +w and -w get codes of the same size).
    `row_max`, for a slice of a row split over processes (Chapter 14), turns the slice's
    largest |w| into the whole row's, so that each slice gets the codes one process gives it."""
    w = w.float().contiguous()   # row-major codes, as the packed kernel reads them, whatever w's layout
    amax = w.abs().amax(dim=1)
    scale = (amax if row_max is None else row_max(amax)).clamp(min=1e-12) / 127   # the row's largest |w| becomes 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]
# --8<-- [end:int8]


# --8<-- [start:int4]
def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric, per group of `group_size` inputs: w ~ (q - 8) * scale + zero, q in 0..15.

    A group's range [min, max] is cut into 15 equal steps, so a lopsided group (all
    positive, say) still gets all 16 levels. `zero` is the value the middle code 8
    stands for; scale and zero are stored in bf16, the format the kernels read.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the layer's {k} inputs")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k).contiguous(), scale, zero   # row-major codes, whatever w's layout


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = q.reshape(n, scale.shape[1], -1).float() - 8
    return (groups * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)
# --8<-- [end:int4]


# --8<-- [start:weights]
class QuantizedWeight:
    """One weight matrix [out, in] in a compact format. `matmul` is x @ Wᵀ; indexing returns
    dequantised rows, which is all an embedding lookup needs from a (tied) table."""

    def __init__(self, w: torch.Tensor, path: str):
        if path not in ("fast", "reference"):
            raise ValueError(f"path must be 'fast' or 'reference', got {path!r}")
        self.path = path
        self.dtype, self.device = w.dtype, w.device   # what it hands back, as the tensor would
        self.shape = tuple(w.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "reference":   # dequantise the whole matrix, then an ordinary matmul
            return x @ self.dequantize().to(x.dtype).T
        return self.packed_mm(x)

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.dequantize_rows(rows).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class HalfWeight(QuantizedWeight):
    """bf16 or fp16 storage: half the bytes, no scales. The matmul runs in that dtype."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, path: str = "fast"):
        super().__init__(w, path)
        self.w = w.to(dtype)

    def tensors(self): return [self.w]
    def dequantize(self): return self.w.float()
    def dequantize_rows(self, rows): return self.w[rows]
    def packed_mm(self, x): return (x.to(self.w.dtype) @ self.w.T).to(x.dtype)
# --8<-- [end:weights]


# --8<-- [start:int8-weight]
class Int8Weight(QuantizedWeight):
    """Per-channel int8. Fast path: _weight_int8pack_mm (int8 weights, bf16 activations)."""

    def __init__(self, w: torch.Tensor, path: str = "fast", row_max=None):
        super().__init__(w, path)
        self.q, self.scale = quantize_int8(w, row_max)
        self.kernel_scale = self.scale.to(KERNEL_DTYPE)

    def tensors(self): return [self.q, self.scale] + ([self.kernel_scale] if self.path == "fast" else [])
    def dequantize(self): return dequantize_int8(self.q, self.scale)
    def dequantize_rows(self, rows): return self.q[rows].float() * self.scale[rows, None]

    def packed_mm(self, x):
        return torch._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q, self.kernel_scale).to(x.dtype)
# --8<-- [end:int8-weight]


# --8<-- [start:w8a8]
def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations to int8 as they arrive, one scale per row (per token): x ~ xq * xs. The rule
    is the weights' own (a row's largest |x| becomes 127), applied to each token's row."""
    xq, xs = quantize_int8(x)
    return xq, xs[:, None]


def int8_mm(xq: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32, summed exactly: on a CPU with VNNI, four products per lane per instruction."""
    rows = xq.shape[0]
    if xq.is_cuda and rows <= 16:   # CUDA's int8 GEMM takes more than 16 rows: pad, then cut
        xq = torch.cat([xq, xq.new_zeros(17 - rows, xq.shape[1])])
    return torch._int_mm(xq, q_t)[:rows]


class W8A8Weight(Int8Weight):
    """int8 weights *and* int8 activations (W8A8, as vLLM calls it). Chapter 12's int8 kernel
    does float arithmetic for every row it multiplies, so a batch of 32 costs about 32 times a
    row; here the activations are quantised too, per token, and the products are integer dot
    products, which the CPU does several to an instruction. The price: each token's activations
    lose precision as well, which costs more than the weights' rounding (the model-wide table
    measures it)."""

    def __init__(self, w: torch.Tensor, path: str = "fast", row_max=None):
        super().__init__(w, path, row_max)
        self.q_t = self.q.T.contiguous()    # [in, out]: the layout torch._int_mm reads fastest
        self.q = self.q_t.T                 # rows for a lookup, as a view: one copy of the codes

    def tensors(self): return [self.q_t, self.scale]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows_int8(x)
        if self.path == "reference":        # the same rounding, then float arithmetic in plain sight
            return ((xq.float() * xs) @ self.dequantize().T).to(x.dtype)
        return (int8_mm(xq, self.q_t) * xs * self.scale).to(x.dtype)
# --8<-- [end:w8a8]


# --8<-- [start:int4-pack]
def inner_k_tiles(k: int) -> int:
    """How many 16-input k-tiles CUDA's int4 packer lays side by side: 8, 4 or 2, and they must
    divide the layer's k inputs evenly. The largest that fits: SmolLM2's 576 inputs (36 tiles) take 4."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"CUDA's int4 kernel needs a multiple of 32 inputs, the layer has {k}")


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """[n, k] codes 0..15 -> [n, k / 2] bytes, two codes each, row-major: CUDA's packer refuses
    anything but a contiguous tensor, and the model keeps its weights input-major (column-major)."""
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()


class Int4Weight(QuantizedWeight):
    """Group-wise int4. The fast path keeps only the kernel's packed copy (two codes per
    byte, in the tile order the kernel walks) and scale/zero as one [groups, out, 2] tensor."""

    def __init__(self, w: torch.Tensor, group_size: int, path: str = "fast"):
        super().__init__(w, path)
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size!r}")
        q, self.scale, self.zero = quantize_int4(w, group_size)
        self.group_size, self.shape = group_size, tuple(w.shape)
        if path == "reference":
            self.q = q
            return
        self.scale_zero = torch.stack([self.scale, self.zero], dim=-1).transpose(0, 1).contiguous()
        if w.device.type == "cpu":   # the CPU kernel packs from one int32 code per weight
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:   # CUDA's tinygemm (not run here: no GPU): two codes per byte first
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pack_pairs(q), inner_k_tiles(self.shape[1]))
        del self.scale, self.zero    # they live on in scale_zero

    def tensors(self):
        return [self.q, self.scale, self.zero] if self.path == "reference" else [self.packed, self.scale_zero]

    def dequantize(self):
        if self.path != "reference":
            raise ValueError("a fast-path Int4Weight keeps only the kernel's packed copy; build it with "
                             "path='reference' to dequantise")
        return dequantize_int4(self.q, self.scale, self.zero)

    def dequantize_rows(self, rows): return self.dequantize()[rows]

    def packed_mm(self, x):
        # torch._name, not torch.ops.aten.name: the same kernel without a Python dispatch layer,
        # a few microseconds saved on each of the 121 calls of a decode step
        mm = torch._weight_int4pack_mm_for_cpu if x.device.type == "cpu" else torch._weight_int4pack_mm
        return mm(x.to(KERNEL_DTYPE), self.packed, self.group_size, self.scale_zero).to(x.dtype)
# --8<-- [end:int4-pack]


# --8<-- [start:model]
def check_settings(quant: str, group_size: int, head: str = "auto") -> None:
    if quant not in MODES:
        raise ValueError(f"unknown quantisation mode {quant!r} (choose from {', '.join(MODES)})")
    if (quant == "int4" or head == "int4") and group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size!r}")
    if head not in HEAD_FORMATS:
        raise ValueError(f"unknown head format {head!r} (choose from {', '.join(HEAD_FORMATS)})")


def head_format(quant: str, head: str) -> str:
    """What the embedding / LM head is stored in: 'auto' is the layers' format, but int8 for int4."""
    if quant == "none":
        return "f32"
    if head == "auto":
        return "int8" if quant in ("int4", "w8a8") else quant   # the head's errors land on the logits
    return head


def quantize_weight(w: torch.Tensor, quant: str, group_size: int, path: str, row_max=None):
    """`row_max`: see quantize_int8 (int4's groups lie within a slice, and need none)."""
    if quant == "int8":
        return Int8Weight(w, path, row_max)
    if quant == "w8a8":
        return W8A8Weight(w, path, row_max)
    if quant == "int4":
        return Int4Weight(w, group_size, path)
    return HalfWeight(w, {"bf16": torch.bfloat16, "fp16": torch.float16}[quant], path)


def quantize(model: LlamaModel, quant: str, group_size: int = 64, head: str = "auto",
             path: str = "fast") -> LlamaModel:
    """The same model with its matrices swapped for QuantizedWeights; the forward pass is
    unchanged, since Chapter 6's `linear` asks each weight for its own matmul.

    `head` chooses the format of the embedding table and the LM head (one matrix when tied):
    by default the layers' own, except that int4 layers get an int8 head, since the head's
    errors land on the logits directly. An int4 head keeps a separate int8 table for the
    embedding, which needs rows it can look up: int8 has them, packed int4 has not. The swap
    reaches inside wrappers (a tensor-parallel shard, Chapter 14): each rank quantises its own,
    and a wrapper that holds a slice of each row (`row_max`) has the row's scale chosen over
    every slice: otherwise each rank's codes differ from one process's, and so do the tokens.
    """
    check_settings(quant, group_size, head)
    head = head_format(quant, head)
    c = model.config
    layers = {f"model.layers.{i}.{layer}" for i in range(c.num_layers) for layer in LINEAR_LAYERS}

    def layer_format(name: str, w: torch.Tensor):
        try:
            return quantize_weight(w, quant, group_size, path, getattr(model.w[name], "row_max", None))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    w = map_weights(model, layer_format, layers) if quant != "none" else dict(model.w)
    if head != "f32":
        embed = "int8" if head == "int4" else head
        tied = c.tie_word_embeddings and model.w["lm_head"] is model.w["embed"]
        w["embed"] = map_weights(model, lambda _, t: quantize_weight(t, embed, group_size, path), {"embed"})["embed"]
        w["lm_head"] = w["embed"] if tied and embed == head else map_weights(
            model, lambda _, t: quantize_weight(t, head, group_size, path), {"lm_head"})["lm_head"]
    quantized = model.with_weights(w)
    quantized.format_name = format_name_of(quant, group_size, head)
    return quantized
# --8<-- [end:model]


def format_name_of(quant: str, group_size: int, head: str = "auto") -> str:
    """'int4 g32, head int4': the layers' format, then the head's where it is not the default."""
    name = {"none": "float32"}.get(quant, quant) + (f" g{group_size}" if quant == "int4" else "")
    if head_format(quant, head) != head_format(quant, "auto"):
        name += f", head {head_format(quant, head)}"
    return name


# --8<-- [start:weight-format]
class WeightFormat:
    """A weight format as a feature an engine is handed: model -> model, like every feature
    of `load_model` (Chapter 6). Settings are checked now, before any weights load."""

    def __init__(self, quant: str, group_size: int = 32, head: str = "auto", path: str = "fast"):
        check_settings(quant, group_size, head)
        self.quant, self.group_size, self.head, self.path = quant, group_size, head, path
        self.name = format_name_of(quant, group_size, head)

    def __call__(self, model: LlamaModel) -> LlamaModel:
        return quantize(model, self.quant, self.group_size, self.head, self.path)
# --8<-- [end:weight-format]
