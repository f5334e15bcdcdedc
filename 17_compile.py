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
    paged attention a decode row's attention read from the pool where it lies, through its
                    block table: a C++ kernel (minivllm/csrc), or the same written as plain
                    torch for torch.compile (slower on the CPUs measured)
    fused glue      residual add + RMSNorm, RoPE on q and k, SiLU·mul: each one compiled
                    kernel instead of several

`compile_model(model)` applies them to any model Chapters 6, 12 and 14 build; `LLM` takes
`compile=True` (`--compile`) and hands the model runner a `Compile()` step after the weight
format. The code lives in `minivllm/compile.py`; this script checks it.

    python 17_compile.py                 # eager vs compiled: the same logits? the compile's cost
    python 17_compile.py --kernel        # the attention kernel with and without its compiler flags
    python 17_compile_demo.py --part steps       # a step's time, eager vs compiled, batch 1 to 32
    python 17_compile_demo.py --plot ch13.png    # a step taken apart, every format, batch 1 and 32
    python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --compile \\
           --engine minivllm:LLM --peer vllm
"""

from __future__ import annotations

import argparse
import time

import torch

from kit import cli
from kit.workloads import reference_prompts
from minivllm import cpu_attention
from minivllm import threads as cpu_threads
from minivllm.compile import FUSED_GLUE_MIN_TOKENS, CompiledModel, compile_model, silu_mul
from minivllm.config import DEFAULT_BLOCK_SIZE
from minivllm.kv_cache import KVPool
from minivllm.llm import LLM
from minivllm.model import LlamaModel, ModelConfig
from minivllm.model_files import resolve_model


class CompiledEngine(LLM):
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


# --8<-- [start:glue-costs]
def glue_costs(compiled: CompiledModel, pool: KVPool, rounds: int = 5, context: int = 256) -> list[tuple]:
    """One forward with the glue fused, and with the same glue run eagerly, by step size: decode
    steps of 1 to 32 rows (`context` tokens cached each) and prefills of 64 to 512 tokens. The two
    alternate, best of `rounds` each. Returns (step, tokens, fused ms, eager ms) rows."""
    bs, saved = pool.block_size, compiled.fused_glue_min_tokens
    width = -(-(context + 1) // bs)
    steps = [(f"decode, {n} row{'s' * (n > 1)}", pool.batch([[1]] * n, [list(range(r * width, (r + 1) * width))
                                                                        for r in range(n)], [context] * n, "cpu"))
             for n in (1, 8, 32)]
    steps += [(f"prefill, {n} tokens", pool.batch([[1] * n], [list(range(-(-n // bs)))], [0], "cpu"))
              for n in (64, 128, 256, 512)]
    rows = []
    try:
        for label, batch in steps:
            best = {0: float("inf"), 1 << 30: float("inf")}      # threshold 0: always fused; huge: never
            for _ in range(rounds + 1):                          # the first round warms both up
                for threshold in best:
                    compiled.fused_glue_min_tokens = threshold
                    start = time.perf_counter()
                    compiled.forward(batch, pool)
                    best[threshold] = min(best[threshold], time.perf_counter() - start)
            rows.append((label, len(batch.token_ids), best[0] * 1e3, best[1 << 30] * 1e3))
    finally:
        compiled.fused_glue_min_tokens = saved
    return rows
# --8<-- [end:glue-costs]


def print_glue_costs(rows: list[tuple]) -> None:
    print(f"\n[fused glue or eager glue?]  one forward, the same packed weights, best of each; "
          f"the engine fuses from {FUSED_GLUE_MIN_TOKENS} tokens a step")
    print(f"  {'step':<22}{'tokens':>7}{'fused ms':>10}{'eager ms':>10}   fused is")
    for label, tokens, fused, eager in rows:
        verdict = f"{eager / fused:.2f}x as fast"
        print(f"  {label:<22}{tokens:>7}{fused:>10.1f}{eager:>10.1f}   {verdict}")


def kernel_flags(config, rows: int = 32, context: int = 256, rounds: int = 7) -> list[tuple]:
    """The C++ attention kernel built three ways and timed on one layer's decode attention, `rows`
    rows of `context` cached tokens in shuffled blocks, the builds alternating, best of `rounds`:
    as shipped, without -ffast-math (exp one element at a time), without -fopenmp (one thread).
    Returns (build, ms) rows."""
    builds = {"as shipped": cpu_attention.CFLAGS,
              "without -ffast-math": [f for f in cpu_attention.CFLAGS if f != "-ffast-math"],
              "without -fopenmp": [f.replace("-fopenmp", "-fopenmp-simd") for f in cpu_attention.CFLAGS]}
    kernels = {name: cpu_attention.compile_kernel(flags) for name, flags in builds.items()}
    bs = DEFAULT_BLOCK_SIZE
    width = -(-context // bs)
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(rows * width * bs, config.num_kv_heads, config.head_dim, generator=gen)
                      for _ in range(2))
    tables = torch.randperm(rows * width, generator=gen).view(rows, width)
    q, lens = torch.randn(rows, config.num_heads, config.head_dim, generator=gen), torch.full((rows,), context)
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(rounds + 1):                    # the first round warms each up
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for _ in range(10):                    # a layer's call, ten times: one call is too short to time
                kernel.paged_decode_attention(q, k_pool, v_pool, tables, lens, bs)
            best[name] = min(best[name], (time.perf_counter() - start) / 10)
    return [(name, ms * 1e3) for name, ms in best.items()]


def print_kernel_flags(timings: list[tuple], config, rows: int, context: int) -> None:
    print(f"[the attention kernel's compiler flags]  one layer: {rows} rows x {context} cached tokens, "
          f"{config.num_heads} query heads on {config.num_kv_heads} KV heads, {torch.get_num_threads()} threads")
    shipped = timings[0][1]
    for name, ms in timings:
        print(f"  {name:<22}{ms:>7.2f} ms   {ms / shipped:4.2f}x the time as shipped")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 13: eager vs compiled, on the same weights: the same "
                                                 "logits? Timings: 17_compile_demo.py")
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--show-kernel", action="store_true", help="only print the C++ generated for SiLU·mul")
    parser.add_argument("--kernel", action="store_true",
                        help="only time the C++ attention kernel built with and without its compiler flags")
    parser.add_argument("--glue", action="store_true",
                        help="also time a forward with the glue fused and eager, decode and prefill sizes")
    args = parser.parse_args()
    if args.show_kernel:
        with torch.inference_mode():
            print(generated_kernel())
        return
    folder = resolve_model(args.model)
    if args.kernel:
        config = ModelConfig.from_folder(folder)   # the shapes only: no weights loaded
        print(f"[{cpu_threads.cpu_name()}]  float32, torch {torch.__version__}")
        rows, context = 32, 256
        print_kernel_flags(kernel_flags(config, rows, context), config, rows, context)
        return
    eager = LlamaModel.from_folder(folder)
    compiled = compile_model(eager)
    c = eager.config
    pool = KVPool.from_memory(c, 2048 * c.kv_bytes_per_token(torch.float32))
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
    for prompt in reference_prompts():
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
          f"{same} of {len(reference_prompts())} prompts")
    # --8<-- [end:check]
    if args.glue:
        print_glue_costs(glue_costs(compiled, KVPool.from_memory(c, (32 * 272 + 600) * c.kv_bytes_per_token(torch.float32))))


if __name__ == "__main__":
    main()
