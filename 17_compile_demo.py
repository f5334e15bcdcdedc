"""17_compile_demo.py - Chapter 13: a decode step taken apart, eager against compiled, every weight format.

For each weight format (float32, bf16, int8, int4) and batch size (1 and 32 rows, each with
`--context` tokens cached) one decode step is timed whole, then its parts alone on the same
shapes:

    matmuls     every x @ Wᵀ of the step (4 per layer and the LM head), the format's kernel
    attention   each layer's attention over the paged pool: eager copies the blocks into a
                rectangle for SDPA, compiled reads them in place with the C++ kernel
                (`inductor`: the same in place, written as plain torch under torch.compile)
    the rest    the step minus both: norms, RoPE, SiLU·mul, residual adds, KV writes, Python

beside the floor Chapter 4's roofline sets: the step's bytes (weights and the keys and values
it reads) over this machine's measured memory bandwidth. Eager and compiled alternate, so a
busy machine slows both alike.

    python 17_compile_demo.py --part steps           # whole steps, eager vs compiled, batch 1 to 32
    python 17_compile_demo.py --part steps --thread-counts 1 2     # ... and what a second thread does
    python 17_compile_demo.py                        # both tables (a few minutes: four formats)
    python 17_compile_demo.py --formats none int4 --plot ch13-step.png
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from kit import cli
from minivllm import LLM
from minivllm import threads as cpu_threads
from minivllm.compile import CompiledModel, compile_model
from minivllm.kv_cache import KVPool
from minivllm.model_files import resolve_model
from minivllm.model_runner import load_model
from minivllm.packed import packed_weights
from minivllm.quantization import WeightFormat
from minivllm.roofline import measure_bandwidth


def best_ms(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def decode_batch(pool, batch_size: int, context: int):
    """A decode step of batch_size rows, each `context` tokens deep, in blocks spread over the pool."""
    width = -(-(context + 1) // pool.block_size)
    if batch_size * width > pool.num_blocks:
        raise ValueError(f"{batch_size} rows of {context} tokens need {batch_size * width} blocks; "
                         f"the pool has {pool.num_blocks}")
    order = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * width:(i + 1) * width] for i in range(batch_size)]
    return pool.batch([[1]] * batch_size, tables, [context] * batch_size, "cpu")


def steps(folder, context: int, rounds: int, thread_counts: list[int]) -> None:
    """Whole steps, eager against compiled: decodes of 1, 8 and 32 rows, and one long prefill."""
    eager = load_model(folder)
    compiled = compile_model(eager)
    c = eager.config
    pool = KVPool.from_memory(c, (32 * (context + 32) + 600) * c.kv_bytes_per_token(torch.float32))
    print(f"[compile]  warm-up {compiled.warm_up(pool):.1f} s")
    print(f"[one step, ms, best of {rounds}]  eager and compiled alternate, same pool, same batch")
    settings = [(f"decode, batch {b}, {context} cached", decode_batch(pool, b, context)) for b in (1, 8, 32)]
    settings.append(("prefill, 500 tokens", pool.batch([[1] * 500], [list(range(32))], [0], "cpu")))
    saved = torch.get_num_threads()
    for label, batch in settings:
        for threads in thread_counts:     # thread counts alternate too: a neighbour's load hits all alike
            torch.set_num_threads(threads)
            e = best_ms(lambda: eager.forward(batch, pool), rounds)
            k = best_ms(lambda: compiled.forward(batch, pool), rounds)
            print(f"  {label:<28} {threads} thr  eager {e:7.1f}   compiled {k:7.1f}   {e / k:4.2f}x", flush=True)
    torch.set_num_threads(saved)


# --8<-- [start:parts]
def matmuls(model, rows: int):
    """The step's matmuls alone: the same weights, inputs of the same shapes."""
    c = model.config
    inputs = {n: torch.randn(rows, k) for n, k in (("qkv", c.hidden_size), ("o", c.num_heads * c.head_dim),
                                                   ("gate_up", c.hidden_size), ("down", c.intermediate_size))}

    def run():
        for i in range(c.num_layers):
            for name, x in inputs.items():
                model.linear(x, f"model.layers.{i}.{name}")
        model.linear(inputs["qkv"], "lm_head")
    return run


def attention(model, pool, batch):
    """Every layer's attention alone, over the step's batch, as this model does it."""
    c = model.config
    q = torch.randn(len(batch.token_ids), c.num_heads, c.head_dim)
    if isinstance(model, CompiledModel):
        return lambda: [model.attention_of(i, q, batch, pool) for i in range(c.num_layers)]
    return copy_then_sdpa(model, pool, batch, q)


def in_place(model, pool, batch):
    """The same attention through paged_decode_attention under torch.compile, the in-place
    path written as plain torch, for the inductor column."""
    c, was = model.config, model.decode_attention
    q = torch.randn(len(batch.token_ids), c.num_heads, c.head_dim)

    def run():
        model.decode_attention = "compiled"
        try:
            for i in range(c.num_layers):
                model.attention_of(i, q, batch, pool)
        finally:
            model.decode_attention = was
    return run


def copy_then_sdpa(model, pool, batch, q):
    c = model.config

    def eager():
        for i in range(c.num_layers):
            k, v = pool.context(i, batch)
            model.attend(q, k, v, batch)
    return eager
# --8<-- [end:parts]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 13: a decode step taken apart, eager vs compiled.")
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--formats", nargs="+", choices=("none", "bf16", "int8", "int4"),
                        default=["none", "bf16", "int8", "int4"], help="weight formats (none: float32)")
    parser.add_argument("--batch-sizes", nargs="+", type=cli.integer(1, 64), default=[1, 32])
    parser.add_argument("--context", type=cli.integer(1, 2000), default=256, help="tokens each row has cached")
    parser.add_argument("--rounds", type=cli.integer(1, 50), default=5, help="timed repeats (best kept)")
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), help="draw the table as stacked bars")
    parser.add_argument("--part", choices=("steps", "apart", "all", "verification"), default="all",
                        help="steps: whole steps, eager vs compiled; apart: a decode step per format, in parts; "
                             "verification: Chapter 10's verification cost on packed weights (not in all)")
    parser.add_argument("--thread-counts", nargs="+", type=cli.integer(1, 256), metavar="N",
                        help="steps: time each at these thread counts too (default: the current one)")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    print(f"[{cpu_threads.cpu_name()}]  float32 activations, torch {torch.__version__}")
    if args.part in ("steps", "all"):
        steps(folder, args.context, args.rounds, args.thread_counts or [torch.get_num_threads()])
    if args.part in ("apart", "all"):
        apart(folder, args)
    if args.part == "verification":
        verification(folder)


def verification(folder) -> None:
    """Chapter 10's verification, timed again: feeding 1 to 9 tokens of one sequence, on the
    weights as loaded and on the same weights packed, as the compiled model holds them."""
    spec_demo = importlib.import_module("14_speculative_decoding_demo")
    plain = LLM(str(folder), device="cpu")
    try:
        print("\n[What a verification costs: one forward of the model, one sequence, 400 tokens cached]")
        spec_demo.print_costs({"float32 weights as loaded": spec_demo.verification_cost(plain),
                               "packed by oneDNN": spec_demo.verification_cost(
                                   plain, weights=packed_weights(plain.runner.model))})
    finally:
        plain.close()


def apart(folder, args) -> None:
    bandwidth = measure_bandwidth(torch.device("cpu"))
    print(f"\n[a decode step taken apart]  memory bandwidth {bandwidth / 1e9:.1f} GB/s (Chapter 4's measurement)")
    print(f"{'format':<8}{'batch':>6}  {'mode':<9}{'step':>8}{'matmuls':>9}{'attention':>10}{'rest':>8}"
          f"{'floor':>8}{'inductor':>10}   ms")
    rows = []
    for quant in args.formats:
        eager = load_model(folder, features=[] if quant == "none" else [WeightFormat(quant)])
        compiled = compile_model(eager)
        c = eager.config
        pool = KVPool.from_memory(c, (max(args.batch_sizes) * (args.context + 32) + 64)
                                  * c.kv_bytes_per_token(torch.float32))
        compiled.warm_up(pool)
        for b in args.batch_sizes:
            batch = decode_batch(pool, b, args.context)
            kv_bytes = b * (args.context + 1) * c.kv_bytes_per_token(torch.float32)
            floor = (eager.weight_bytes + kv_bytes) / bandwidth * 1e3
            for mode, model in (("eager", eager), ("compiled", compiled)):
                step = best_ms(lambda: model.forward(batch, pool), args.rounds)
                mm = best_ms(matmuls(model, b), args.rounds)
                att = best_ms(attention(model, pool, batch), args.rounds)
                paged_ms = best_ms(in_place(model, pool, batch), args.rounds) if model is compiled else None
                rows.append({"format": quant.replace("none", "float32"), "batch": b, "mode": mode, "step": step,
                             "matmuls": mm, "attention": att, "rest": max(step - mm - att, 0.0), "floor": floor,
                             "in_place": paged_ms})
                r = rows[-1]
                print(f"{r['format']:<8}{b:>6}  {mode:<9}{step:>8.1f}{mm:>9.1f}{att:>10.1f}{r['rest']:>8.1f}"
                      f"{floor:>8.1f}" + (f"{paged_ms:>10.1f}" if paged_ms else ""), flush=True)
        mine = [r for r in rows if r["format"] == quant.replace("none", "float32")]   # (eager, compiled) per batch
        speedups = [f"{e['step'] / c['step']:.2f}x eager at batch {e['batch']}" for e, c in zip(mine[::2], mine[1::2])]
        print(f"  {mine[0]['format']}: compiled step {', '.join([speedups[0], speedups[-1]][:len(speedups)])}")
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        subset = [r for r in rows if r["batch"] == b]
        labels = [f"{r['format']}\n{r['mode']}" for r in subset]
        left = [0.0] * len(subset)
        for part, colour in (("matmuls", "#4c72b0"), ("attention", "#dd8452"), ("rest", "#8c8c8c")):
            values = [r[part] for r in subset]
            ax.barh(labels, values, left=left, color=colour, label=part)
            left = [a + v for a, v in zip(left, values)]
        ax.scatter([r["floor"] for r in subset], labels, marker="|", s=400, color="black", label="roofline floor")
        ax.invert_yaxis()
        ax.set_xlabel("ms per decode step")
        ax.set_title(f"batch {b}")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("A decode step taken apart: eager vs compiled, per weight format")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[plot] {path}")


if __name__ == "__main__":
    main()
