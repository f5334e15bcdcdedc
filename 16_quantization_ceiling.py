"""16_quantization_ceiling.py - how fast can quantised weights make batch-1 decode, with these kernels?

A decode step is the 121 matmuls of its weights (4 per layer, and the LM head) plus
everything else: norms, RoPE, attention, the KV-cache writes, Python. Quantisation only
shrinks the first part. This times the parts apart, per weight format, on the real model:

    matmuls          one step's 121 matmuls back to back (with the casts to and from bf16)
    everything else  whole decode steps with every matmul replaced by a ready-made result
    whole step       real decode steps

The formats alternate in every round, and the medians are shown.

    python 16_quantization_ceiling.py
    python 16_quantization_ceiling.py --modes none int8 int4-g32 --rounds 9
    python 16_quantization_ceiling.py --device cuda     # (the default is the best device there is)

The parts are timed apart, so on a busy machine they can add up to more than the whole
step; the script then says so under the table.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import textwrap
import time

import torch

from kit import cli
from kit.quant_modes import parse_mode
from minivllm.batch import RaggedBatch
from minivllm.model import LlamaModel
from minivllm.model_files import model_folder, pick_device, pick_dtype
from minivllm.model_runner import load_model
from minivllm.quantization import format_name_of, quantize
from minivllm.threads import thread_count

matmuls_ms = importlib.import_module("13_matmul_bound").matmuls_ms   # one decode step's weight matmuls


# --8<-- [start:hollow]
def without_matmuls(model: LlamaModel) -> LlamaModel:
    """The same model, except that linear() hands back a ready-made zero tensor of the right shape."""
    c, hollow, ready = model.config, copy.copy(model), {}
    out_features = {"qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, "o": c.hidden_size,
                    "gate_up": 2 * c.intermediate_size, "down": c.hidden_size, "lm_head": c.vocab_size}

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        key = (x.shape[0], name.rsplit(".", 1)[-1])
        if key not in ready:
            ready[key] = torch.zeros(x.shape[0], out_features[key[1]], dtype=x.dtype, device=x.device)
        return ready[key]
    hollow.linear = linear
    return hollow
# --8<-- [end:hollow]


def step_ms(model: LlamaModel, context: int = 40, steps: int = 16) -> float:
    """Median time of a whole batch-1 decode step after a `context`-token prefill."""
    cache, device = model.new_cache(1, context + steps), model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model.forward(RaggedBatch.build([list(range(100, 100 + context))], [0], [0], context + steps, device),
                  cache)
    times = []
    for t in range(steps):
        batch = RaggedBatch.build([[5]], [0], [context + t], context + steps, device)
        sync()
        t0 = time.perf_counter()
        model.forward(batch, cache)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def parts_exceeding_the_whole(median: dict[str, list[float]], slack: float = 0.05) -> list[str]:
    """Modes whose matmuls and everything else add up to more than a whole step (by more than
    `slack`). On a quiet machine the parts fit inside the whole; timed apart on a busy one, they
    need not, and then no row of the table can be read as a breakdown."""
    return [name for name, (mm, rest, step) in median.items() if mm + rest > step * (1 + slack)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 12: the matmuls' share of a batch-1 decode step.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "int4-g32", "int4-g64"])
    parser.add_argument("--rounds", type=cli.integer(1, 100), default=7, help="alternating rounds (the median is shown)")
    args = parser.parse_args()
    try:
        # float32 first: every ratio is against it; a typo fails before the model loads
        modes = [parse_mode(spec) for spec in dict.fromkeys(["none", *args.modes])]
        device = pick_device(args.device)
        base = load_model(model_folder(args.model), pick_dtype(None, device), device)   # as ModelEngine loads it
        models = {format_name_of(*mode): base if mode[0] == "none" else quantize(base, *mode) for mode in modes}
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    mm, rest, step = {n: [] for n in models}, {n: [] for n in models}, {n: [] for n in models}
    hollow = {name: without_matmuls(model) for name, model in models.items()}
    with torch.inference_mode():
        for r in range(args.rounds):
            print(f"[round {r + 1}/{args.rounds}]", file=sys.stderr, flush=True)
            for name, model in models.items():
                matmuls_ms(model)                                # warm: the first pass pays for page faults
                mm[name].append(statistics.median(matmuls_ms(model) for _ in range(5)))
                rest[name].append(step_ms(hollow[name]))
                step[name].append(step_ms(model))
    median = {name: [statistics.median(m[name]) for m in (mm, rest, step)] for name in models}
    first = median[next(iter(models))]
    where = thread_count() if device.type == "cpu" else str(device)
    print(f"\n[Chapter 12] batch-1 decode on {where}, median of {args.rounds} "
          f"alternating rounds; ratios: float32's time over the mode's\n")
    print(f"  {'mode':<14}{'matmuls':>20}{'everything else':>20}{'whole step':>20}")
    for name, times in median.items():
        print("  " + f"{name:<14}" + "".join(f"{t:>10.1f} ms ({f / t:.2f}x)" for t, f in zip(times, first)))
    over = parts_exceeding_the_whole(median)
    if over:
        print("\n" + textwrap.fill(
            f"warning: for {', '.join(over)}, matmuls + everything else add up to more than the whole step. "
            f"The parts are timed apart, so the machine's load changed in between: read these rows as noise, "
            f"and rerun on a quieter machine or with more --rounds.", width=100,
            initial_indent="  ", subsequent_indent="  "))


if __name__ == "__main__":
    main()
