"""10_profile.py - where one decode step's time goes, and how far each part is from the machine's limits.

A decode step at batch 1 reads every weight once to make one token: its floor is
weight bytes / memory bandwidth. At batch 32 the same bytes make 32 tokens, so the
floor moves towards FLOPs / matmul speed: Chapter 4's roofline. This measures both
limits on the machine at hand with Chapter 4's functions (a big reduction for bandwidth,
a big GEMM for FLOP/s) and times the parts of real decode steps of Chapter 6's model,
loaded as `ModelEngine` loads it (its forward's optional `timer` hook):

    embedding   token lookup and the RoPE angles
    attention   RMSNorm, fused QKV, RoPE, KV-cache write, SDPA, output projection (x layers)
    mlp         RMSNorm, fused gate/up, SwiGLU, down projection (x layers)
    lm_head     final RMSNorm and the vocabulary projection of the last tokens
    sampling    choosing the token (argmax here)
    overhead    everything else in the step: building the batch, Python, the loop

    python 10_profile.py --plot ch6-profile.png
    python 10_profile.py --layouts        # the weights' memory layout: row-major vs input-major matmuls
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from kit import cli
from kit.workloads import reference_prompts
from minivllm.batch import RaggedBatch
from minivllm.model_files import load_tokenizer, model_folder, pick_device, pick_dtype
from minivllm.model_runner import load_model
from minivllm.roofline import measure_bandwidth, measure_matmul_peak
from minivllm.threads import thread_count

PARTS = ("embedding", "attention", "mlp", "lm_head", "sampling", "overhead")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StepTimer:
    """A context-manager factory that adds each named block's wall time to a total."""

    def __init__(self, device: torch.device):
        self.device, self.totals = device, defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        _sync(self.device)
        t = time.perf_counter()
        yield
        _sync(self.device)
        self.totals[name] += time.perf_counter() - t


# --8<-- [start:limits]
def machine_limits(device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """(memory read bandwidth in bytes/s, float32 matmul speed in FLOP/s), best of `repeats`:
    the two roofs of Chapter 4, measured by its functions."""
    return (measure_bandwidth(device, repeats=repeats),
            measure_matmul_peak(device, torch.float32, repeats=repeats))
# --8<-- [end:limits]


@torch.inference_mode()
def time_steps(m, tokenizer, batch_size: int, steps: int) -> dict[str, float]:
    """Mean seconds per decode step of model `m` spent in each part, over `steps` greedy steps."""
    device = m.device
    pool = reference_prompts()
    prompts = [tokenizer(pool[i % len(pool)]).input_ids for i in range(batch_size)]
    max_len = max(map(len, prompts)) + steps + 1
    cache = m.new_cache(batch_size, max_len)
    rows = list(range(batch_size))
    logits = m.forward(RaggedBatch.build(prompts, rows, [0] * batch_size, max_len, device), cache)
    cached = [len(p) for p in prompts]
    timer, total = StepTimer(device), 0.0
    for _ in range(steps):
        t = time.perf_counter()
        with timer("sampling"):
            tokens = logits.argmax(-1).tolist()
        batch = RaggedBatch.build([[tok] for tok in tokens], rows, cached, max_len, device)
        logits = m.forward(batch, cache, timer=timer)
        _sync(device)
        total += time.perf_counter() - t
        cached = [n + 1 for n in cached]
    parts = {name: timer.totals[name] / steps for name in PARTS[:-1]}
    parts["overhead"] = max(0.0, total / steps - sum(parts.values()))
    parts["total"] = total / steps
    return parts


# --8<-- [start:profile]
def profile_decode(m, tokenizer, batch_sizes=(1, 32), steps: int = 16) -> dict:
    """Per-part step times of model `m` at each batch size, and the floors the machine allows."""
    time_steps(m, tokenizer, 1, 2)                            # warm-up: first calls allocate
    bandwidth, flops = machine_limits(m.device)
    matmul_params = m.num_parameters - m.config.vocab_size * m.config.hidden_size * (
        0 if m.config.tie_word_embeddings else 1)            # the embedding lookup is not a matmul
    table = {"bandwidth": bandwidth, "flops": flops, "weight_bytes": m.weight_bytes, "rows": {}}
    for b in batch_sizes:
        parts = time_steps(m, tokenizer, b, steps)
        parts["floor_bandwidth"] = m.weight_bytes / bandwidth  # every weight read once per step
        parts["floor_flops"] = 2 * matmul_params * b / flops   # one multiply-add per weight per row
        table["rows"][b] = parts
    return table
# --8<-- [end:profile]


# --8<-- [start:layouts]
@torch.inference_mode()
def time_layouts(model, batch_sizes=(1, 2, 4, 8, 16, 32), rounds: int = 9) -> dict[int, tuple[float, float]]:
    """Seconds for the 30 layers' four matmuls, x @ Wᵀ, at each batch size: weights stored row
    by row ([out, in], as the checkpoint has them) and input by input (`10_model.input_major`,
    as the model keeps them). Best of `rounds`, the two layouts alternating in every round.
    On a CPU the clock is the process's CPU time, which other processes on a busy machine do
    not inflate (with one thread, it is the time the matmuls really ran)."""
    clock = time.perf_counter if model.device.type == "cuda" else time.process_time
    names = [n for n in model.w if n.endswith(("qkv", "o", "gate_up", "down"))]
    layouts = {"row-major": [model.w[n].contiguous() for n in names],      # a copy, laid out row by row
               "input-major": [model.w[n] for n in names]}
    table = {}
    for b in batch_sizes:
        x = {w.shape[1]: torch.randn(b, w.shape[1], device=model.device) for w in layouts["input-major"]}
        best = {name: float("inf") for name in layouts}
        for _ in range(rounds):
            for name, weights in layouts.items():
                t = clock()
                for w in weights:
                    x[w.shape[1]] @ w.T
                _sync(model.device)
                best[name] = min(best[name], clock() - t)
        table[b] = (best["row-major"], best["input-major"])
    return table
# --8<-- [end:layouts]


def print_layouts(table: dict[int, tuple[float, float]]) -> None:
    print(f"\n[Weight layout]  the layers' matmuls x @ Wᵀ (all 30 layers), CPU time, best of alternating "
          f"rounds, {thread_count()}")
    print(f"  {'batch':>5}{'row-major ms':>15}{'input-major ms':>17}{'input-major speed':>20}")
    for b, (row, col) in table.items():
        print(f"  {b:>5}{row * 1e3:>15.2f}{col * 1e3:>17.2f}{row / col:>19.2f}x")


def print_profile(table: dict) -> None:
    sizes = list(table["rows"])
    print(f"\n[Profile of one decode step]  memory read {table['bandwidth'] / 1e9:.1f} GB/s, "
          f"float32 matmul {table['flops'] / 1e9:.0f} GFLOP/s (measured here)")
    print(f"  {'part':<12}" + "".join(f"{f'batch {b} ms':>14}{'share':>7}" for b in sizes))
    for part in PARTS + ("total",):
        cells = "".join(f"{table['rows'][b][part] * 1e3:>14.2f}{table['rows'][b][part] / table['rows'][b]['total']:>7.0%}"
                        for b in sizes)
        print(f"  {part:<12}{cells}")
    for b in sizes:
        r = table["rows"][b]
        bound = max(r["floor_bandwidth"], r["floor_flops"])
        print(f"  batch {b:>2}: {b / r['total']:7.1f} tokens/s; floors: weights/bandwidth "
              f"{r['floor_bandwidth'] * 1e3:.2f} ms, FLOPs/matmul speed {r['floor_flops'] * 1e3:.2f} ms "
              f"-> the step runs at {bound / r['total']:.0%} of the tighter floor")


def plot_profile(table: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(table["rows"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.6))
    for ax, b in zip(axes if len(sizes) > 1 else [axes], sizes):
        r = table["rows"][b]
        # The floors bound the whole step, not each part: the top bar is the one to hold them against.
        ax.barh(["whole step", *PARTS][::-1], [r[p] * 1e3 for p in PARTS[::-1]] + [r["total"] * 1e3],
                color=["#4c6ef5"] * len(PARTS) + ["#868e96"])
        ax.axvline(r["floor_bandwidth"] * 1e3, color="#e8590c", ls="--", label="floor: weights / bandwidth")
        ax.axvline(r["floor_flops"] * 1e3, color="#2b8a3e", ls=":", label="floor: FLOPs / matmul speed")
        ax.set(title=f"batch {b}: {r['total'] * 1e3:.1f} ms per step", xlabel="ms per decode step")
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[plot] {path}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Chapter 6: where one decode step's time goes, against the floors.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), default=None, help="save a bar chart")
    parser.add_argument("--layouts", action="store_true",
                        help="instead: time the layers' matmuls with the weights row-major and input-major")
    args = parser.parse_args()
    try:
        device, folder = pick_device(args.device), model_folder(args.model)
        model, tokenizer = load_model(folder, pick_dtype(None, device), device), load_tokenizer(folder)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.layouts:
        print_layouts(time_layouts(model))
        return
    table = profile_decode(model, tokenizer)
    print_profile(table)
    if args.plot:
        plot_profile(table, args.plot)


if __name__ == "__main__":
    main()
