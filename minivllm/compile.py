"""Chapter 13: compiled steps. Same model, same arithmetic, fewer trips to memory.

    packed weights  each matrix handed to oneDNN once, at load, in the blocked layout its
                    kernel reads (vLLM's CPU backend does the same); float32 and bf16
                    (minivllm/packed.py)
    paged attention a decode row's attention read from the pool in place, through its block
                    table: a C++ kernel (minivllm/cpu_attention.py), or the same written as
                    plain torch for torch.compile to fuse (an option: measured slower)
    fused glue      residual add + RMSNorm, RoPE on q and k, SiLU·mul: each one compiled
                    kernel instead of several, in steps of FUSED_GLUE_MIN_TOKENS tokens or
                    more (below that, entering four compiled regions a layer costs more
                    than the passes over memory they save)

`Compile()` is the feature an engine is handed: it applies to any model Chapters 6, 12 and
14 build. `17_compile.py` checks it against the eager model and shows its cost.

On CUDA there is nothing to pack (oneDNN is a CPU library): compile=True there means the fused
glue, which inductor writes as Triton kernels, and a step that runs without Chapter 15's CUDA
graphs. A GPU decode step is bound by its launches, not by the glue's trips to memory, so on
a GPU the default (graphs, no compile) is the faster choice.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from minivllm import cpu_attention
from minivllm.kv_cache import PagedBatch
from minivllm.model import LlamaModel, apply_rope, rms_norm, rope_angles
from minivllm.packed import packed_weights

# How decode rows of a paged batch attend: "kernel" reads the pool in place in C++
# (minivllm/cpu_attention.py), "compiled" in place through paged_decode_attention below under
# torch.compile, "copy" copies the blocks into a rectangle for SDPA (Chapter 7); "auto" is the
# kernel where it can run, else the copy. `python 17_compile_demo.py --part apart` times all three.
DECODE_ATTENTION = ("auto", "kernel", "compiled", "copy")


def check_decode_attention(how) -> str:
    if how not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, got {how!r}")
    return how


# Below this many tokens in a step, the glue runs eagerly. Entering a compiled region costs about
# 10 us (guards, a cache lookup, the wrapper), paid 4 times in each of 30 layers; at decode sizes
# the passes over memory it saves are smaller than that. `python 17_compile.py --glue` measures
# both sides by step size: on a 2-core Intel Xeon the fused glue lost below 256 tokens a step
# (a one-row decode 1.16 times as long), broke even at 256 and won at 512 (5%).
FUSED_GLUE_MIN_TOKENS = 256

# --8<-- [start:paged-attention]
def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """One new query per sequence against its cached keys, read through its block table.

    q [seqs, heads, head_dim]; pools [blocks * block_size, kv_heads, head_dim]. Written as
    products and sums rather than a matmul, so that the compiler fuses the gather into the
    loop that reads each key: `k_pool[slot]` below is an address, never a copy. The query
    heads sharing a KV head read it once (grouped-query attention).
    """
    n, width = block_tables.shape
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    t = torch.arange(width * block_size, device=q.device)
    slot = block_tables[:, t // block_size] * block_size + t % block_size       # [seqs, ctx]
    k, v = k_pool[slot], v_pool[slot]                                           # [seqs, ctx, kv_heads, dim]
    q = q.view(n, 1, kv_heads, heads // kv_heads, head_dim)
    scores = (q * k.unsqueeze(3)).sum(-1) * head_dim ** -0.5                    # [seqs, ctx, kv_heads, group]
    hidden = (t.view(1, -1) >= context_lens.view(n, 1)).view(n, -1, 1, 1)       # beyond a row's context
    weights = scores.masked_fill(hidden, float("-inf")).softmax(dim=1)
    return (weights.unsqueeze(-1) * v.unsqueeze(3)).sum(1).reshape(n, heads * head_dim)
# --8<-- [end:paged-attention]


# --8<-- [start:fused]
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add and the next RMSNorm, one pass: (x + delta, its normalised copy)."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """The fused QKV output split into q, k, v, with q and k rotated in the same kernel."""
    qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
# --8<-- [end:fused]


def distinct_sizes(fn):
    """fn with torch's use_duck_shape off while it runs, and put back as found afterwards.
    Two sizes that happen to be equal while tracing (a batch of 2 rows, 2 KV heads) would
    otherwise be assumed equal forever, and the kernel rebuilt the first time they differ.
    torch reads the setting only when it traces, and it traces only inside a call to a compiled
    op (the first call, the warm-up, or any later recompilation), so scoping every call scopes
    them all; other torch.compile users in the process keep torch's default. A whole forward
    is wrapped too, so that its hundred op calls set the setting once, not once each."""
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        global _inside
        if _inside:
            return fn(*args, **kwargs)
        saved, fx_config.use_duck_shape, _inside = fx_config.use_duck_shape, False, True
        try:
            return fn(*args, **kwargs)
        finally:
            fx_config.use_duck_shape, _inside = saved, False
    return scoped


_inside = False   # within distinct_sizes already (one engine loop per process calls the model)


# --8<-- [start:compiled]
class Compiled:
    """fn under torch.compile, or fn itself where no compiler works here: the first failure is
    reported once and the eager op stays. Shapes start static; a dimension seen at a second
    size becomes a symbol, so one kernel then serves every batch (see warm_up)."""

    def __init__(self, fn, enabled: bool = True):
        self.fn, self.name = fn, fn.__name__
        self.compiled = torch.compile(fn) if enabled else None

    @distinct_sizes   # two sizes equal while tracing are not assumed equal forever (above)
    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:   # no C++ compiler, an unsupported op: eager is always right
                print(f"[compile] {self.name}: falling back to eager ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:120]})", flush=True)
                self.compiled = None
        return self.fn(*args)
# --8<-- [end:compiled]


# --8<-- [start:model]
class CompiledModel(LlamaModel):
    """Chapter 6's forward with packed weights, fused glue and paged decode attention.

    decode_attention says how decode rows of a paged batch attend (DECODE_ATTENTION); every
    other part (prefill chunks, verifications, a cache of rows) keeps Chapter 6's copy-then-SDPA.
    """

    compiled = True    # engines report it in features()

    @classmethod
    def from_model(cls, model: LlamaModel, enabled: bool = True, decode_attention: str = "auto",
                   fused_glue_min_tokens: int = FUSED_GLUE_MIN_TOKENS) -> CompiledModel:
        compiled = cls(model.config, packed_weights(model))
        compiled.decode_attention = decode_attention
        compiled.format_name = model.format_name     # a Chapter 12 model keeps its name
        compiled.ops = {fn.__name__: Compiled(fn, enabled)
                        for fn in (paged_decode_attention, add_rms_norm, rope_split, silu_mul)}
        compiled.eager_glue = {fn.__name__: fn for fn in (add_rms_norm, rope_split, silu_mul)}
        compiled.fused_glue_min_tokens = fused_glue_min_tokens
        return compiled

    def glue_for(self, num_tokens: int) -> dict:
        """The fused glue for a step big enough to gain from it, the same functions run eagerly
        for a smaller one (FUSED_GLUE_MIN_TOKENS says why)."""
        return self.ops if num_tokens >= self.fused_glue_min_tokens else self.eager_glue

    def decode_attention_for(self, cache) -> str:
        """"kernel", "compiled" or "copy" on this cache: "auto" is the kernel where it runs (a
        float32 pool on the CPU, with a C++ compiler), else the copy; a cache of rows always copies."""
        if not hasattr(cache, "block_size"):
            return "copy"
        if self.decode_attention in ("auto", "kernel"):   # not buildable here: said once by cpu_attention
            return "kernel" if cpu_attention.available(cache.k[0]) else "copy"
        return self.decode_attention

    def attention_of(self, i: int, q, batch, cache) -> torch.Tensor:
        """Each part of the batch attends in its own way: decode rows in place, prefills via a copy."""
        outs = []
        for rows, tokens, part in batch.parts:
            tables = getattr(batch, "block_tables", None)
            how = self.decode_attention_for(cache) if tables is not None and max(part.lengths) == 1 else "copy"
            if how != "copy":
                outs.append(self._decode(i, q[tokens], tables[rows], part, cache, how))
                continue
            if tables is not None:   # a prefill part: its own rows' blocks, copied for SDPA
                width = -(-part.context_len // cache.block_size)
                part = PagedBatch(part.token_ids, part.positions, part.slots, list(range(len(part.lengths))),
                                        part.starts, part.lengths, tables[rows, :width].contiguous())
            k, v = cache.context(i, part)
            outs.append(self.attend(q[tokens], k, v, part))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, i: int, q, tables, part, cache, how: str) -> torch.Tensor:
        n, q = len(part.lengths), q.contiguous()    # one memory layout: one compiled kernel
        lens = torch.tensor([s + 1 for s in part.starts], device=q.device)
        if how == "kernel":                         # the C++ kernel: any width, any number of rows
            return cpu_attention.paged_decode_attention(q, cache.k[i], cache.v[i], tables, lens, cache.block_size)
        if tables.shape[1] == 1:   # never width 1 or one row: the compiler would specialise on it
            tables = torch.cat([tables, tables], dim=1)
        if n == 1:
            q, tables, lens = q.repeat(2, 1, 1), tables.repeat(2, 1), lens.repeat(2)
        out = self.ops["paged_decode_attention"](q, cache.k[i], cache.v[i], tables, lens, cache.block_size)
        return out[:n]

    @torch.inference_mode()
    @distinct_sizes
    def forward(self, batch, cache, all_logits: bool = False, timer=None, num_logits=None) -> torch.Tensor:
        """Chapter 6's forward pass (LlamaModel.forward), the same arithmetic in the same order,
        with the glue between matmuls handed to `ops` (fused, or eager below the threshold)
        and decode attention read from the pool in place: token for token the eager model's."""
        c, w, ops = self.config, self.w, self.glue_for(len(batch.token_ids))
        x = w["embed"][batch.token_ids]
        cos, sin = rope_angles(batch.positions, self.inv_freq, self.dtype)
        h = rms_norm(x, w["model.layers.0.norm1"], c.rms_norm_eps)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = self.linear(h, p + "qkv").view(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
            q, k, v = ops["rope_split"](qkv, cos, sin, c.num_heads, c.num_kv_heads)
            cache.k[i].index_copy_(0, batch.slots, k)
            cache.v[i].index_copy_(0, batch.slots, v)
            attn = self.linear(self.attention_of(i, q, batch, cache), p + "o")
            x, h = ops["add_rms_norm"](x, attn, w[p + "norm2"], c.rms_norm_eps)
            mlp = self.linear(ops["silu_mul"](self.linear(h, p + "gate_up")), p + "down")
            last = i == c.num_layers - 1
            x, h = ops["add_rms_norm"](x, mlp, w["norm" if last else f"model.layers.{i + 1}.norm1"], c.rms_norm_eps)
        if num_logits is not None:
            ends = torch.tensor(batch.lengths).cumsum(0).tolist()
            h = h[torch.tensor([j for end, m in zip(ends, num_logits) for j in range(end - m, end)], device=h.device)]
        elif not all_logits:
            h = h[torch.tensor(batch.lengths, device=h.device).cumsum(0) - 1]
        return self.linear(h, "lm_head").float()
    # --8<-- [end:model]

    # --8<-- [start:warm-up]
    def warm_up(self, pool) -> float:
        """Compile before serving, on the first blocks of an idle pool. Each kernel is traced at
        two sizes, so the compiler learns which dimensions vary (tokens, rows, blocks per row)
        and keeps the model's own (heads, head_dim, hidden) as constants it can vectorise over;
        one token and one row are sizes it always treats apart, so they are warmed too.
        Returns the seconds it took; later runs load the kernels from inductor's disk cache."""
        start, bs = time.perf_counter(), pool.block_size
        if pool.num_blocks < 9:
            raise ValueError(f"warming up needs a pool of 9 blocks or more, this one has {pool.num_blocks}")
        tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        steps = [([[1, 2, 3], [4, 5, 6]], [0, 0]),                 # prefills: 6 tokens, then 9
                 ([[1, 2, 3, 4, 5], [6, 7, 8, 9]], [0, 0]),
                 ([[1], [2]], [bs, bs]),                           # decodes: 2 rows of 2 blocks,
                 ([[1], [2], [3]], [2 * bs, 2 * bs, 2 * bs]),      # 3 rows of 3, one row
                 ([[1]], [bs])]
        threshold, self.fused_glue_min_tokens = self.fused_glue_min_tokens, 0   # the glue traced too
        try:
            for ids, starts in steps:
                self.forward(pool.batch(ids, tables[:len(ids)], starts, self.device), pool)
        finally:
            self.fused_glue_min_tokens = threshold
        for k, v in zip(pool.k, pool.v):   # leave the pool as it was found: zeros
            k.zero_()
            v.zero_()
        return time.perf_counter() - start
    # --8<-- [end:warm-up]


def compile_model(model: LlamaModel, enabled: bool = True, decode_attention: str = "auto",
                  fused_glue_min_tokens: int = FUSED_GLUE_MIN_TOKENS) -> CompiledModel:
    """model -> the same model, compiled. decode_attention: one of DECODE_ATTENTION.
    fused_glue_min_tokens: the smallest step whose glue runs fused (0: every step's)."""
    if not isinstance(model, LlamaModel):
        raise ValueError(f"compile works on a LlamaModel, got {type(model).__name__}")
    check_decode_attention(decode_attention)
    if isinstance(fused_glue_min_tokens, bool) or not isinstance(fused_glue_min_tokens, int) \
            or fused_glue_min_tokens < 0:
        raise ValueError(f"fused_glue_min_tokens must be an integer >= 0, got {fused_glue_min_tokens!r}")
    return CompiledModel.from_model(model, enabled, decode_attention, fused_glue_min_tokens)


class Compile:
    """Compiled steps as a feature an engine is handed (`compile=True`): model -> model, like
    a weight format, and applied after it, so that the packed weights are the format's."""

    name = "compile"

    def __init__(self, decode_attention: str = "auto", enabled: bool = True):
        self.decode_attention, self.enabled = check_decode_attention(decode_attention), enabled

    def __call__(self, model: LlamaModel) -> CompiledModel:
        return compile_model(model, self.enabled, self.decode_attention)
