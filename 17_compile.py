"""17_compile.py - Chapter 13: compiled steps. Same model, same arithmetic, fewer trips to memory.

Chapter 4's roofline says a decode step should cost about what reading its bytes costs. Our
eager step costs several times that, and the profile of Chapter 6 says where the rest goes:

    matmuls        the BLAS repacks each weight matrix on every call at a few rows (2 to 32)
    attention      every layer copies each sequence's KV blocks into one padded rectangle,
                   then SDPA reads the copy: the cache is read twice and written once
    glue           RMSNorm, RoPE, SiLU·mul and residual adds: a dozen small kernels a layer,
                   each reading and writing the whole activation

Three changes, none of which touches the model's arithmetic:

    packed weights  each matrix handed to oneDNN once, at load, in the blocked layout its
                    kernel reads (vLLM's CPU backend does the same); float32 and bf16
    paged attention a decode row's attention written as plain torch over its block table;
                    torch.compile turns it into one C++ loop that reads keys where they lie
                    (an option: on the CPU measured, Chapter 7's copy + SDPA was faster)
    fused glue      residual add + RMSNorm, RoPE on q and k, SiLU·mul: each one compiled
                    kernel instead of several

`compile_model(model)` applies them to any model Chapter 6 or Chapter 12 builds; engines take
`compile=True` (`--compile`), found by name in kit/plugins.py as weight formats are.

    python 17_compile.py                 # eager vs compiled: the same logits? the compile's cost
    python 17_compile_demo.py --part steps       # a step's time, eager vs compiled, batch 1 to 32
    python 17_compile_demo.py --plot ch13.png    # a step taken apart, every format, batch 1 and 32
    python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --compile \\
           --engine 13_continuous_batching_engine:ContinuousBatchingEngine --peer vllm
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.fx.experimental._config  # noqa: F401  (use_duck_shape, below)
import torch.nn.functional as F

from kit import cli
from kit import threads as cpu_threads

setup = importlib.import_module("01_setup")
model10 = importlib.import_module("10_model")
paged = importlib.import_module("11_paged_kv")
cb13 = importlib.import_module("13_continuous_batching_engine")
quant16 = importlib.import_module("16_quantization")


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


def packed_weights(model: model10.LlamaModel) -> dict:
    """Every matrix a matmul reads, packed where oneDNN has a kernel for its format: float32
    tensors and bf16 HalfWeights. int8 and int4 keep Chapter 12's packed kernels; the embedding
    table stays a table (a tied LM head gets its own packed copy)."""
    w = dict(model.w)
    if not can_pack(model.device):
        return w
    for name, weight in model.w.items():
        if name == "embed" or (isinstance(weight, torch.Tensor) and weight.dim() != 2):
            continue
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            w[name] = PackedWeight(weight, torch.float32)
        elif isinstance(weight, quant16.HalfWeight) and weight.w.dtype == torch.bfloat16 and weight.path == "fast":
            w[name] = PackedWeight(weight.w, torch.bfloat16)
    return w
# --8<-- [end:packed]


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
    return x, model10.rms_norm(x, weight, eps)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """The fused QKV output split into q, k, v, with q and k rotated in the same kernel."""
    qk = model10.apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
# --8<-- [end:fused]


# --8<-- [start:compiled]
class Compiled:
    """fn under torch.compile, or fn itself where no compiler works here: the first failure is
    reported once and the eager op stays. Shapes start static; a dimension seen at a second
    size becomes a symbol, so one kernel then serves every batch (see warm_up)."""

    def __init__(self, fn, enabled: bool = True):
        self.fn, self.name = fn, fn.__name__
        # Two sizes that happen to be equal while tracing (a batch of 2 rows, 2 KV heads) would
        # otherwise be assumed equal forever, and the kernel rebuilt the first time they differ.
        torch.fx.experimental._config.use_duck_shape = False
        self.compiled = torch.compile(fn) if enabled else None

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
class CompiledModel(model10.LlamaModel):
    """Chapter 6's forward with packed weights, fused glue and paged decode attention.

    With paged_attention, decode rows of a paged batch attend in place through their block
    tables; every other part (prefill chunks, verifications, a cache of rows) keeps Chapter 6's
    copy-then-SDPA path.
    """

    compiled = True    # engines report it in features()

    @classmethod
    def from_model(cls, model: model10.LlamaModel, enabled: bool = True,
                   paged_attention: bool = False) -> CompiledModel:
        compiled = cls(model.config, packed_weights(model))
        compiled.paged_attention = paged_attention   # off: measured slower here (17_compile_demo.py)
        for attr in ("quant", "group_size", "head"):           # a Chapter 12 model's description
            if hasattr(model, attr):
                setattr(compiled, attr, getattr(model, attr))
        compiled.format_name = getattr(model, "format_name", None)
        compiled.ops = {fn.__name__: Compiled(fn, enabled)
                        for fn in (paged_decode_attention, add_rms_norm, rope_split, silu_mul)}
        return compiled

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[name]
        return x @ w.T if isinstance(w, torch.Tensor) else w.matmul(x)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in {id(t): t for t in self.w.values()}.values())

    def attention_of(self, i: int, q, batch, cache) -> torch.Tensor:
        """Each part of the batch attends in its own way: decode rows in place, prefills via a copy."""
        outs = []
        for rows, tokens, part in batch.parts:
            tables = getattr(batch, "block_tables", None)
            if tables is not None and max(part.lengths) == 1 and self.paged_attention:
                outs.append(self._decode(i, q[tokens], tables[rows], part, cache))
                continue
            if tables is not None:   # a prefill part: its own rows' blocks, copied for SDPA
                width = -(-part.context_len // cache.block_size)
                part = paged.PagedBatch(part.token_ids, part.positions, part.slots, list(range(len(part.lengths))),
                                        part.starts, part.lengths, tables[rows, :width].contiguous())
            k, v = cache.context(i, part)
            outs.append(self.attend(q[tokens], k, v, part))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, i: int, q, tables, part, cache) -> torch.Tensor:
        n, q = len(part.lengths), q.contiguous()    # one memory layout: one compiled kernel
        lens = torch.tensor([s + 1 for s in part.starts], device=q.device)
        if tables.shape[1] == 1:   # never width 1 or one row: the compiler would specialise on it
            tables = torch.cat([tables, tables], dim=1)
        if n == 1:
            q, tables, lens = q.repeat(2, 1, 1), tables.repeat(2, 1), lens.repeat(2)
        out = self.ops["paged_decode_attention"](q, cache.k[i], cache.v[i], tables, lens, cache.block_size)
        return out[:n]

    @torch.inference_mode()
    def forward(self, batch, cache, all_logits: bool = False, timer=None, num_logits=None) -> torch.Tensor:
        c, w, ops = self.config, self.w, self.ops
        x = w["embed"][batch.token_ids]
        cos, sin = model10.rope_angles(batch.positions, self.inv_freq, self.dtype)
        h = model10.rms_norm(x, w["model.layers.0.norm1"], c.rms_norm_eps)
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
        for ids, starts in steps:
            self.forward(pool.batch(ids, tables[:len(ids)], starts, self.device), pool)
        for k, v in zip(pool.k, pool.v):   # leave the pool as it was found: zeros
            k.zero_()
            v.zero_()
        return time.perf_counter() - start
    # --8<-- [end:warm-up]


def compile_model(model: model10.LlamaModel, enabled: bool = True, paged_attention: bool = False) -> CompiledModel:
    """The plugin engines find by name: model -> the same model, compiled (kit/plugins.py).
    paged_attention: decode rows attend in place through the compiled kernel above, instead
    of Chapter 7's copy and SDPA; off by default, since on the CPU measured it was slower."""
    if not isinstance(model, model10.LlamaModel):
        raise ValueError(f"compile works on a LlamaModel, got {type(model).__name__}")
    return CompiledModel.from_model(model, enabled, paged_attention)


class CompiledEngine(cb13.ContinuousBatchingEngine):
    """Chapter 9's assembled engine with compile=True: its own name, so that one benchmark run
    can put it beside the eager engine (`--engine 17_compile:CompiledEngine`)."""

    def __init__(self, *args, compile: bool = True, **kwargs):
        super().__init__(*args, compile=compile, **kwargs)


# ---------------------------------------------------------------- the demonstration
# --8<-- [start:show-kernel]
def generated_kernel(fn=silu_mul, *example) -> str:
    """The C++ inductor writes for one fused op: what `torch.compile` turned Python into."""
    from torch._inductor.utils import run_and_get_code

    example = example or (torch.randn(4, 2 * 1536),)
    _, sources = run_and_get_code(torch.compile(fn), *example)
    quotes = "'" * 3       # each kernel's source sits in an r-string of the generated module
    kernels = [part.split(quotes)[0] for part in sources[0].split("r" + quotes)[1:]]
    return "\n".join(kernels).strip()
# --8<-- [end:show-kernel]


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 13: eager vs compiled, on the same weights: the same "
                                                 "logits? Timings: 17_compile_demo.py")
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--show-kernel", action="store_true", help="only print the C++ generated for SiLU·mul")
    args = parser.parse_args()
    if args.show_kernel:
        with torch.inference_mode():
            print(generated_kernel())
        return
    engine04 = importlib.import_module("04_engine")
    folder = setup.resolve_model(args.model)
    eager = model10.LlamaModel.from_folder(folder)
    compiled = compile_model(eager)
    c = eager.config
    pool = paged.KVPool.from_memory(c, 2048 * c.kv_bytes_per_token(torch.float32))
    print(f"[{cpu_threads.cpu_name()}]  float32, torch {torch.__version__}")
    print(f"[weights]  eager {eager.weight_bytes / 1e6:.0f} MB; packed {compiled.weight_bytes / 1e6:.0f} MB "
          f"(the tied LM head gets a packed copy of its own)")
    seconds = compiled.warm_up(pool)
    print(f"[compile]  warm-up {seconds:.1f} s (inductor's cache: later starts reuse its kernels)")

    # --8<-- [start:check]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("\n[same logits?]  each reference prompt's prefill, then 32 greedy tokens fed to both")
    same, worst = 0, 0.0
    for prompt in engine04.reference_prompts():
        ids = tokenizer(prompt).input_ids
        runs = []
        for model in (eager, compiled):
            table, tokens, logits = list(range(-(-(len(ids) + 32) // pool.block_size))), list(ids), []
            for step in range(32):
                start = 0 if step == 0 else len(tokens) - 1
                out = model.forward(pool.batch([tokens[start:]], [table], [start], "cpu"), pool)
                logits.append(out[0])
                tokens.append(int(out[0].argmax()))
            runs.append((tokens[len(ids):], torch.stack(logits)))
        worst = max(worst, float((runs[0][1][0] - runs[1][1][0]).abs().max()))
        same += runs[0][0] == runs[1][0]
    print(f"  prefill logits: max |eager - compiled| = {worst:.1e}; greedy tokens identical on "
          f"{same} of {len(engine04.reference_prompts())} prompts")
    # --8<-- [end:check]



if __name__ == "__main__":
    main()
