"""Chapter 6: a model we own. The Llama forward pass in plain PyTorch.

    embedding -> N x [ RMSNorm -> attention (RoPE, grouped-query) -> + residual
                       RMSNorm -> SwiGLU MLP                      -> + residual ]
              -> RMSNorm -> LM head (the embedding matrix again, when tied)

The batch is flat and ragged (the new tokens of all sequences in one [total_tokens] vector,
with per-sequence lengths), so one forward carries one request's prefill beside others'
single decode tokens; the KV cache is tensors we own, each new key/value written to its slot.
Every matmul goes through `linear`, the one place weights are read: later chapters change
the weights (formats, packing, shards), not this forward pass. One later chapter writes the
same arithmetic a second way: Chapter 13's `CompiledModel.forward` fuses the glue between the
matmuls (residual + RMSNorm, RoPE, SiLU·mul) into compiled kernels, and a test holds its
tokens to this one. `10_model.py` checks this forward against Hugging Face's model.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from minivllm.batch import KVCache, RaggedBatch
from minivllm.weights import input_major, matmul, nbytes, unique

SUPPORTED_MODEL_TYPES = ("llama",)


# --8<-- [start:config]
@dataclass(frozen=True)
class ModelConfig:
    """The numbers of config.json that the forward pass needs, checked once."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None      # Llama-3 style long-context scaling, or None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_json(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not implemented by 10_model.py "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for unsupported in ("attention_bias", "mlp_bias"):
            if raw.get(unsupported):
                raise ValueError(f"config sets {unsupported}=true: biases are not implemented by 10_model.py")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not implemented (only silu)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        # transformers 5 keeps rope settings in rope_parameters; older configs in rope_theta/rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not implemented (only default and llama3)")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """The config of a model folder, read from its config.json alone (no weights)."""
        return cls.from_json(json.loads((Path(folder) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Chapter 3's formula (08_kv_cache_sizes.py): keys and values, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
# --8<-- [end:config]


# --8<-- [start:rope]
def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """One rotation speed per pair of head dimensions; Llama 3 slows the slow ones further."""
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
    s = config.rope_scaling
    if s:  # wavelengths longer than the original context are stretched by `factor`, smoothly
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_context = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_context / wavelen - low) / (high - low)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin of every token's angles, [tokens, 1, head_dim], as apply_rope reads them.

    Llama pairs dimension j with j + head_dim/2 (the 'rotate half' layout), so both halves
    share one angle. sin's first half is stored negated: that is the minus sign of the rotation.
    """
    angles = positions.unsqueeze(1).float() * inv_freq             # [tokens, head_dim / 2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).unsqueeze(1).to(dtype), torch.cat((-sin, sin), -1).unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] by each token's angle: each pair (a, b) becomes
    (a cos - b sin, b cos + a sin). Rolling the last dimension by half brings every b next to
    its a; the negated half of sin supplies the minus. Three ops, run 30 times per step."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
# --8<-- [end:rope]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector to unit root-mean-square, x / sqrt(mean(x²) + eps), in float32, then by a
    learned gain. torch's F.rms_norm computes exactly that (the same bits as the formula spelled out op
    by op, measured on float32 activations) with less Python and dispatch around it. Half-precision
    models normalise in float32 and apply the gain in their own dtype, as Hugging Face's Llama does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


class LlamaModel:
    """The whole decoder: weights as plain tensors, forward as plain torch calls."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config, self.w = config, weights
        self.dtype, self.device = weights["embed"].dtype, weights["embed"].device
        self.inv_freq = rope_frequencies(config).to(self.device)
        self.format_name: str | None = None    # a weight format's name (Chapter 12); None: as loaded
        self.part = None                       # which part of each tensor was read (Chapter 14); None: all

    def with_weights(self, weights: dict) -> LlamaModel:
        """The same model (config, forward pass, features so far) over other weights."""
        model = copy.copy(self)
        model.w = weights
        return model

    # --8<-- [start:load]
    @classmethod
    def from_folder(cls, folder: str | Path, dtype=torch.float32, device="cpu", part=None) -> LlamaModel:
        """Read config.json and the .safetensors files, one tensor at a time; fuse QKV and gate/up
        as we load. `part(name, config)` says which rows or columns of a tensor to read (a
        tensor-parallel rank's slice, Chapter 14), None for all of it: only that part is read."""
        folder = Path(folder)
        config = ModelConfig.from_folder(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} has no .safetensors weights")
        c, kv = config, config.num_kv_heads * config.head_dim
        with contextlib.ExitStack() as stack:
            # Open every file, read nothing yet: the header says each tensor's name and shape.
            opened = [stack.enter_context(safe_open(file, framework="pt")) for file in files]
            where = {name: f for f in opened for name in f.keys()}

            def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
                if name not in where:
                    raise ValueError(f"{folder}: tensor {name!r} is missing from the safetensors file")
                stored = where[name].get_slice(name)
                if tuple(stored.get_shape()) != shape:
                    raise ValueError(f"{folder}: tensor {name!r} has shape {tuple(stored.get_shape())}, "
                                     f"the config implies {shape}")
                index = part(name, config) if part else None
                tensor = where[name].get_tensor(name) if index is None else stored[index]
                return tensor.to(device=device, dtype=dtype)

            w = {"embed": take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)),
                 "norm": take("model.norm.weight", (c.hidden_size,))}
            if c.tie_word_embeddings:
                w["lm_head"] = w["embed"]     # one matrix, read twice: 113 MB saved on the default model
            else:
                w["lm_head"] = take("lm_head.weight", (c.vocab_size, c.hidden_size))
            for i in range(c.num_layers):
                p = f"model.layers.{i}."
                q = take(p + "self_attn.q_proj.weight", (c.num_heads * c.head_dim, c.hidden_size))
                k = take(p + "self_attn.k_proj.weight", (kv, c.hidden_size))
                v = take(p + "self_attn.v_proj.weight", (kv, c.hidden_size))
                gate = take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
                up = take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
                # Three projections of the same input are one matmul with stacked weights: the
                # input is read once and one larger GEMM keeps the cores busier than three small ones.
                w[p + "qkv"] = input_major(torch.cat([q, k, v]))
                w[p + "gate_up"] = input_major(torch.cat([gate, up]))
                w[p + "o"] = input_major(take(p + "self_attn.o_proj.weight",
                                              (c.hidden_size, c.num_heads * c.head_dim)))
                w[p + "down"] = input_major(take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)))
                w[p + "norm1"] = take(p + "input_layernorm.weight", (c.hidden_size,))
                w[p + "norm2"] = take(p + "post_attention_layernorm.weight", (c.hidden_size,))
        model = cls(config, w)
        model.part = part     # a part read: the config is still the whole model's (Chapter 14 finishes it)
        return model
    # --8<-- [end:load]

    @property
    def weight_bytes(self) -> int:
        return sum(nbytes(w) for w in unique(self.w.values()))   # a tied LM head counts once

    @property
    def num_parameters(self) -> int:
        return sum(w.numel() for w in unique(self.w.values()) if isinstance(w, torch.Tensor))

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ Wᵀ for the weight called `name`: the one place a matmul reads weights."""
        return matmul(self.w[name], x)

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        return KVCache(self.config, rows, max_len, self.dtype, self.device)

    # --8<-- [start:attention]
    def attention(self, i: int, h: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}."
        qkv = self.linear(h, p + "qkv").view(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        # Queries and keys turn by the same angles, and sit side by side: one RoPE call for both.
        qk = apply_rope(qkv[:, :c.num_heads + c.num_kv_heads], cos, sin)
        q, k, v = qk[:, :c.num_heads], qk[:, c.num_heads:], qkv[:, c.num_heads + c.num_kv_heads:]
        cache.k[i].index_copy_(0, batch.slots, k)      # the slot mapping: new K/V into the cache
        cache.v[i].index_copy_(0, batch.slots, v)
        if hasattr(batch, "attend_in_place"):   # Chapter 15: a CUDA graph's decode rows read the pool in place
            return self.linear(batch.attend_in_place(self, i, q, cache), p + "o")
        k, v = cache.context(i, batch)
        parts = [self.attend(q[tokens], k[rows, :part.context_len], v[rows, :part.context_len], part)
                 for rows, tokens, part in batch.parts]
        return self.linear(parts[0] if len(parts) == 1 else torch.cat(parts), p + "o")
    # --8<-- [end:attention]

    # --8<-- [start:attend]
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: RaggedBatch) -> torch.Tensor:
        """Each sequence's queries against its own cached keys: one SDPA call for the batch.

        Ragged queries are padded to the longest one ([seqs, heads, q_len, head_dim]); k and v
        hold every row's keys up to the longest context, and a mask hides, per row, keys beyond
        that row's causal horizon. Decode-only batches (q_len 1) need no query padding, and
        the query heads that share a KV head attend as that head's rows ([seqs, kv_heads,
        group, head_dim]): one pass over each KV head's keys serves its whole group (measured
        1.3 to 1.5 times as fast as SDPA's enable_gqa at 1 to 32 sequences).
        """
        c, n, q_len = self.config, len(batch.lengths), max(batch.lengths)
        if q_len == 1:
            group = c.num_heads // c.num_kv_heads
            out = F.scaled_dot_product_attention(q.view(n, c.num_kv_heads, group, c.head_dim),
                                                 k.transpose(1, 2), v.transpose(1, 2), attn_mask=batch.mask)
            return out.reshape(n, c.num_heads * c.head_dim)
        uniform = len(set(batch.lengths)) == 1
        if uniform:
            qp = q.view(n, q_len, c.num_heads, c.head_dim)
        else:   # scatter the flat queries into a padded rectangle
            qp = q.new_zeros(n, q_len, c.num_heads, c.head_dim)
            qp[batch.pad_index] = q
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=batch.mask,
            is_causal=batch.mask is None and q_len > 1, enable_gqa=c.num_kv_heads != c.num_heads)
        out = out.transpose(1, 2)                              # [seqs, q_len, heads, head_dim]
        return out.reshape(-1, c.num_heads * c.head_dim) if uniform else out[batch.pad_index].flatten(1)
    # --8<-- [end:attend]

    # --8<-- [start:forward]
    @torch.inference_mode()
    def forward(self, batch: RaggedBatch, cache: KVCache, all_logits: bool = False,
                timer=None, num_logits: list[int] | None = None) -> torch.Tensor:
        """Logits of each sequence's last new token, [seqs, vocab] (or of every token, or of the
        last num_logits[i] new tokens of sequence i: a speculative verification, Chapter 10).

        `timer(name)` is an optional context manager factory (10_profile.py uses it).
        """
        c, w = self.config, self.w
        timer = timer or (lambda name: contextlib.nullcontext())
        with timer("embedding"):
            x = w["embed"][batch.token_ids]                    # [total_tokens, hidden]
            cos, sin = rope_angles(batch.positions, self.inv_freq, self.dtype)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            with timer("attention"):
                x = x + self.attention(i, rms_norm(x, w[p + "norm1"], c.rms_norm_eps), batch, cache, cos, sin)
            with timer("mlp"):
                gate, up = self.linear(rms_norm(x, w[p + "norm2"], c.rms_norm_eps), p + "gate_up").chunk(2, dim=-1)
                x = x + self.linear(F.silu(gate) * up, p + "down")  # SwiGLU: gate and up from one matmul
        with timer("lm_head"):
            if num_logits is not None:    # the last few tokens of each sequence predict
                ends = itertools.accumulate(batch.lengths)
                x = x[torch.tensor([j for end, m in zip(ends, num_logits) for j in range(end - m, end)],
                                   device=x.device)]
            elif not all_logits:   # only the last token of each sequence predicts what comes next
                last = torch.tensor(batch.lengths, device=x.device).cumsum(0) - 1
                x = x[last]
            return self.linear(rms_norm(x, w["norm"], c.rms_norm_eps), "lm_head").float()
    # --8<-- [end:forward]
