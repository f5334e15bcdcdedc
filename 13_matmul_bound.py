"""13_matmul_bound.py - how fast could this schedule run the mixed workload on these matmuls?

Continuous batching decides which tokens share a step; it cannot make a step's matrix
multiplies cheaper. So the matmuls alone bound what it can reach: run the workload once,
note every step's shape (tokens in the forward, sequences that sample), then time just the
weight matmuls of each shape and add them up. Attention, the KV gather, sampling and Python
all count as free in that sum, so no attention kernel or leaner loop on these weights and
this GEMM can beat the bound *with these step shapes*. A different schedule (a larger token
budget, say) makes different shapes, and larger matmuls run faster per FLOP. The bound no
schedule can beat is the workload's weight FLOPs, the same whatever the shapes, at the
machine's matmul peak measured as in Chapter 4 (08_roofline.py).

    python 13_matmul_bound.py                       # the 32-request mixed workload, all at once
    python 13_matmul_bound.py --requests 8          # a quicker look: 8 requests, budgets cut to 8/32
    python 13_matmul_bound.py --device cuda         # on a GPU (the default is the best device there is)
    python 13_matmul_bound.py --compile             # Chapter 13's compiled engine, its packed matmuls
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from types import SimpleNamespace

import torch

from kit import cli, workloads
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.roofline import measure_matmul_peak, weight_flops   # Chapters 3 and 4: the FLOPs, the peak
from minivllm.threads import thread_count


# --8<-- [start:matmuls]
def matmuls_ms(model, tokens: int = 1, heads: int = 1) -> float:
    """One forward's weight matmuls and nothing else: `tokens` rows through every layer's four
    matrices, `heads` rows (the sequences that sample) through the LM head."""
    c, device = model.config, model.device
    hidden = torch.randn(tokens, c.hidden_size, device=device)
    inner = torch.randn(tokens, c.intermediate_size, device=device)
    last = torch.randn(heads, c.hidden_size, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)   # a GPU runs ahead of Python
    sync()
    t0 = time.perf_counter()
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name, x in (("qkv", hidden), ("o", hidden), ("gate_up", hidden), ("down", inner)):
            model.linear(x, p + name)
    if heads:
        model.linear(last, "lm_head")
    sync()
    return (time.perf_counter() - t0) * 1e3
# --8<-- [end:matmuls]


def matmul_flops(model, tokens: int = 1, heads: int = 1) -> int:
    """The FLOPs matmuls_ms times, counted as Chapter 3 counts them (from Chapter 6's config)."""
    c = model.config
    return weight_flops(SimpleNamespace(num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                                        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                        vocab_size=c.vocab_size), tokens, heads)


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 9: the matmuls' bound on continuous batching.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--requests", type=cli.integer(1, 1000), default=32,
                        help="first N of the mixed workload (default 32); fewer also cuts every answer's "
                             "budget by N/32, or its 256-token answers would still take 258 steps")
    parser.add_argument("--compile", action="store_true",
                        help="the engine compiled (Chapter 13): the steps and their matmuls on packed weights")
    args = parser.parse_args()
    try:
        engine = LLM(args.model, device=args.device, compile=args.compile)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    params = SamplingParams(ignore_eos=True)
    items = workloads.mixed_workload(engine.tokenizer, args.requests)
    if args.requests < 32:
        items = [dataclasses.replace(it, max_new_tokens=max(2, it.max_new_tokens * args.requests // 32))
                 for it in items]
    engine.generate(items[0].prompt, 2, params)                  # warm-up
    shapes = []
    engine.on_step = lambda work, events: shapes.append((work.num_tokens, len(events)))
    cut = f" (budgets cut to {args.requests}/32)" if args.requests < 32 else ""
    print(f"[run] {len(items)} requests of the mixed workload{cut}, all at once ...", flush=True)
    t0 = time.perf_counter()
    streams = [engine.submit(it.prompt, it.max_new_tokens, params) for it in items]   # each its own budget
    results = [stream.result() for stream in streams]
    wall = time.perf_counter() - t0
    engine.on_step = None
    tokens = sum(r.metrics.output_tokens for r in results)

    print(f"[matmuls] timing the {len(set(shapes))} step shapes ...", flush=True)
    cost = {}
    with torch.inference_mode():
        for shape in sorted(set(shapes)):
            matmuls_ms(engine.model, *shape)                      # warm
            cost[shape] = min(matmuls_ms(engine.model, *shape) for _ in range(5))   # a bound: the fastest
    bound = sum(cost[s] for s in shapes) / 1e3
    # --8<-- [start:peak]
    peak = measure_matmul_peak(torch.device("cpu"), label="matmul peak, float32 GEMM")
    flops_bound = sum(matmul_flops(engine.model, *s) for s in shapes) / peak   # any schedule's
    # --8<-- [end:peak]
    engine.close()

    where = thread_count() if engine.device.type == "cpu" else str(engine.device)
    compiled = ", compiled (packed weights)" if args.compile else ""
    print(f"\n[Chapter 9] {len(shapes)} steps, {tokens} output tokens, on {where}{compiled}\n")
    print(f"  {'':<34}{'seconds':>9}{'tokens/s':>10}")
    print(f"  {'continuous batching, measured':<34}{wall:>9.1f}{tokens / wall:>10.1f}")
    print(f"  {'the same steps, matmuls alone':<34}{bound:>9.1f}{tokens / bound:>10.1f}")
    print(f"  {'their FLOPs at the matmul peak':<34}{flops_bound:>9.1f}{tokens / flops_bound:>10.1f}"
          f"   ({peak / 1e9:.0f} GFLOP/s, as in Chapter 4)")
    print(f"\n  {'tokens in the step':<20}{'steps':>7}{'matmul seconds':>16}")
    buckets = {"1 to 7": [0, 0.0], "8 to 31": [0, 0.0], "32 to 63": [0, 0.0], "64 and more": [0, 0.0]}
    for s in shapes:
        label = list(buckets)[sum(s[0] >= edge for edge in (8, 32, 64))]
        buckets[label][0] += 1
        buckets[label][1] += cost[s] / 1e3
    for label, (n, secs) in buckets.items():
        print(f"  {label:<20}{n:>7}{secs:>16.1f}")


if __name__ == "__main__":
    main()
