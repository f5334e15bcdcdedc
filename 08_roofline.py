"""08_roofline.py - where the time goes: the machine's two limits, and which one a step runs into.

A step of the model must move bytes (every weight, every cached key and value it reads) and
do arithmetic (two FLOPs per weight per token, plus attention). The machine has a limit for
each: memory bandwidth (bytes/s) and matmul speed (FLOP/s). Whichever takes longer bounds
the step. The ratio FLOPs / bytes, the step's *arithmetic intensity*, says which:

    attainable FLOP/s = min(peak FLOP/s, intensity x bandwidth)        (the roofline)

This script measures both limits here, counts a decode step's bytes and FLOPs for the
default model at batch 1, 8 and 32 (and a prefill), times real steps, places them on the
roofline, and predicts from the two limits alone the batch size where decode stops being
memory-bound on this machine.

    python 08_roofline.py
    python 08_roofline.py --threads 1 --plot roofline.png
    python 08_roofline.py --no-steps          # the limits and the prediction only: no model is loaded
"""

from __future__ import annotations

import argparse
import importlib
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from kit import cli
from kit.workloads import reference_prompts
from minivllm import threads
from minivllm.contracts import SamplingParams
from minivllm.model_files import pick_device, resolve_model
from minivllm.roofline import (LLAMA3_8B, as_config, best_time, forward_flops, kv_bytes_per_token, measure_bandwidth,
                               measure_matmul_peak, weight_bytes)

decode_loop = importlib.import_module("07_decode_loop")   # Chapter 2's loop: the steps timed here

BATCHES = (1, 8, 32)
# A data-centre GPU for comparison, from its datasheet (NVIDIA H100 SXM: 3.35 TB/s of HBM3,
# 989 TFLOP/s of dense bf16 matmul), not measured here.
H100 = dict(bandwidth=3.35e12, peak=989e12)
CONTEXT = 128          # tokens each sequence holds when its decode step is measured and priced


# --8<-- [start:cost]
@dataclass(frozen=True)
class StepCost:
    flops: float
    weight_bytes: float
    kv_bytes: float          # cached keys and values read, and the new ones written

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes


def weights_read(config, dtype: torch.dtype, rows: int) -> float:
    """Weight bytes one forward reads: all of them, except that an untied embedding table is
    only looked up (`rows` rows), not read whole. A tied table is read whole as the LM head."""
    total = weight_bytes(config, dtype)
    if getattr(config, "tie_word_embeddings", False):
        return total
    row = config.hidden_size * torch.empty((), dtype=dtype).element_size()
    return total - config.vocab_size * row + min(rows, config.vocab_size) * row


def decode_step_cost(config, batch: int, context: int, dtype: torch.dtype = torch.float32,
                     kv_dtype: torch.dtype | None = None) -> StepCost:
    """One decode step: `batch` sequences, each with `context` cached tokens, one new token each."""
    per_token = kv_bytes_per_token(config, kv_dtype or dtype)
    return StepCost(flops=batch * forward_flops(config, 1, context),
                    weight_bytes=weights_read(config, dtype, batch),
                    kv_bytes=batch * (context + 1) * per_token)


def prefill_cost(config, tokens: int, dtype: torch.dtype = torch.float32) -> StepCost:
    """One prefill of `tokens` prompt tokens: the weights once, every token's keys and values written."""
    return StepCost(flops=forward_flops(config, tokens, 0), weight_bytes=weights_read(config, dtype, tokens),
                    kv_bytes=tokens * kv_bytes_per_token(config, dtype))
# --8<-- [end:cost]


# --8<-- [start:roofline]
@dataclass(frozen=True)
class Roofline:
    bandwidth: float         # bytes/s
    peak: float              # FLOP/s

    @property
    def ridge(self) -> float:
        """The intensity where the roof bends: below it memory bounds a step, above it arithmetic."""
        return self.peak / self.bandwidth

    def attainable(self, intensity: float) -> float:
        return min(self.peak, intensity * self.bandwidth)

    def floor_seconds(self, cost: StepCost) -> float:
        """No step can be faster than its bytes at full bandwidth or its FLOPs at full speed."""
        return max(cost.bytes / self.bandwidth, cost.flops / self.peak)

    def bound(self, cost: StepCost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"


def bend_batch(roof: Roofline, config, context: int, dtype: torch.dtype = torch.float32,
               limit: int = 1 << 14) -> int | None:
    """The smallest batch whose decode step reaches the ridge; None if none up to `limit` does
    (the KV reads grow with the batch too, so at long contexts intensity may never get there)."""
    batch = 1
    while batch <= limit:
        if decode_step_cost(config, batch, context, dtype).intensity >= roof.ridge:
            lo, hi = batch // 2 + 1, batch            # the answer lies in (batch / 2, batch]
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if decode_step_cost(config, mid, context, dtype).intensity >= roof.ridge \
                    else (mid + 1, hi)
            return lo
        batch *= 2
    return None
# --8<-- [end:roofline]


# --8<-- [start:steps]
def context_prompt(tokenizer, tokens: int) -> str:
    """Text of about `tokens` tokens, cut from the reference prompts repeated."""
    pool = " ".join(reference_prompts())
    ids = tokenizer(" ".join([pool] * (1 + tokens // max(1, len(tokenizer(pool).input_ids))))).input_ids
    return tokenizer.decode(ids[:tokens])


def per_token_seconds(generate, prompt: str, new_tokens: int, repeats: int, label: str) -> float:
    """Decode time per token of a whole generate() call: (time for 1 + k tokens - time for 1) / k,
    each the best of `repeats`, so the prefill and the call's fixed costs cancel out."""
    params = SamplingParams(ignore_eos=True)
    one = best_time(lambda: generate(prompt, 1, params), torch.device("cpu"), repeats, f"{label}, 1 token")
    many = best_time(lambda: generate(prompt, 1 + new_tokens, params), torch.device("cpu"), repeats,
                     f"{label}, {1 + new_tokens} tokens")
    return max(many - one, 1e-9) / new_tokens


@torch.inference_mode()
def step_seconds(engine, batch: int, context: int, repeats: int, decode: bool = True) -> float:
    """Best time of one step of our decode loop (Chapter 2): a decode step of `batch` rows over
    `context` cached tokens each, or (decode=False) the prefill of `context` tokens.
    Before each try the cache drops what the previous try appended, so every try does the same work."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, engine.vocab_size, (batch, context), generator=gen).to(engine.device)
    positions = torch.arange(context, device=engine.device).expand(batch, -1)
    if not decode:
        return best_time(lambda: engine.prefill(ids, None, positions), engine.device, repeats, f"prefill {context}")
    logits, cache = engine.prefill(ids, None, positions)
    new_ids, new_positions = logits.argmax(-1, keepdim=True), torch.full((batch, 1), context, device=engine.device)

    def step():
        engine.decode_step(new_ids, None, new_positions, cache)
        cache.crop(-1)                     # a negative crop drops that many of the newest tokens
    return best_time(step, engine.device, repeats, f"decode step, batch {batch}")
# --8<-- [end:steps]


def plot_roofline(roof: Roofline, points: list[tuple[str, StepCost, float]], path: str, title: str,
                  other_peaks: dict[str, float] | None = None) -> None:
    """The roof (log-log) and each (label, cost, measured seconds) at its intensity and achieved FLOP/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = min([0.05] + [c.intensity / 2 for _, c, _ in points])
    hi = max([roof.ridge * 20] + [c.intensity * 2 for _, c, _ in points])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.loglog(xs, [roof.attainable(x) / 1e9 for x in xs], color="black", lw=2, label="roofline (measured limits)")
    for name, peak in (other_peaks or {}).items():
        ax.loglog(xs, [min(peak, x * roof.bandwidth) / 1e9 for x in xs], color="gray", ls="--", lw=1, label=name)
    ax.axvline(roof.ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {roof.ridge:.1f} FLOP/byte", (roof.ridge, roof.peak / 1e9), textcoords="offset points",
                xytext=(5, -15), fontsize=8)
    for i, (label, cost, seconds) in enumerate(points):
        ax.loglog([cost.intensity], [cost.flops / seconds / 1e9], "o", color=f"C{i}", label=label)
        ax.loglog([cost.intensity], [roof.attainable(cost.intensity) / 1e9], "_", color=f"C{i}", ms=14, mew=2)
    ax.set(xlabel="arithmetic intensity (FLOP per byte moved)", ylabel="GFLOP/s", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\n[plot] {path}")


def device_label(device: torch.device) -> str:
    """The name of the device the measurements ran on: the CPU's model, or the GPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return threads.cpu_name() if device.type == "cpu" else str(device)


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 4: the roofline of this machine, and where decode sits on it.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--repeats", type=cli.integer(1, 100), default=5, help="tries per measurement; the fastest counts")
    parser.add_argument("--no-steps", action="store_true", help="measure the limits and predict; time no model steps")
    parser.add_argument("--memory", type=cli.byte_size, default="256MB", help="tensor read to measure bandwidth")
    parser.add_argument("--gemm-size", type=cli.integer(16, 16384), default=2048, help="n of the n x n x n GEMMs")
    parser.add_argument("--plot", type=cli.plot_file(), default=None, help="draw the roofline with the measured steps")
    args = parser.parse_args()
    if args.memory > 16 << 30:
        parser.error("--memory: at most 16GB (a read of that size already takes seconds)")
    try:
        device = pick_device(args.device)
        folder = resolve_model(args.model)
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print(f"[machine] {device_label(device)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    # --8<-- [start:measure]
    n, mib = args.gemm_size, args.memory >> 20
    bandwidth = measure_bandwidth(device, args.memory, args.repeats, label=f"memory read, {mib} MiB")
    peak = measure_matmul_peak(device, torch.float32, n, args.repeats, label=f"float32 GEMM {n}^3")
    bf16 = measure_matmul_peak(device, torch.bfloat16, n, args.repeats, label=f"bf16 GEMM {n}^3")
    roof = Roofline(bandwidth, peak)
    # --8<-- [end:measure]
    print(f"[limits] memory read {bandwidth / 1e9:.1f} GB/s ({mib} MiB summed); matmul float32 {peak / 1e9:.0f}"
          f" GFLOP/s, bf16 {bf16 / 1e9:.0f} GFLOP/s ({n}^3 GEMMs); best of {args.repeats} each")
    print(f"  ridge for float32: {peak / 1e9:.0f} / {bandwidth / 1e9:.1f} = {roof.ridge:.1f} FLOP per byte")

    name = str(folder).rstrip("/").rsplit("/", 1)[-1]
    per_token = forward_flops(config, 1, CONTEXT)
    print(f"\n[{name}, float32]  weights read per step {weights_read(config, torch.float32, 1) / 1e6:.0f} MB,"
          f" {per_token / 1e6:.0f} MFLOP per token at context {CONTEXT},"
          f" KV cache {kv_bytes_per_token(config, torch.float32) / 1024:.0f} KiB per token")
    # --8<-- [start:predict]
    print(f"\n[prediction]  decode steps at context {CONTEXT}, from the two limits alone")
    print(f"  {'batch':>6}{'GFLOP':>8}{'MB moved':>10}{'FLOP/byte':>11}{'bound':>9}{'floor ms':>10}{'tokens/s at most':>18}")
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        cost = decode_step_cost(config, batch, CONTEXT)
        floor = roof.floor_seconds(cost)
        print(f"  {batch:>6}{cost.flops / 1e9:>8.2f}{cost.bytes / 1e6:>10.0f}{cost.intensity:>11.2f}"
              f"{roof.bound(cost):>9}{floor * 1e3:>10.2f}{batch / floor:>18,.0f}")
    bend = bend_batch(roof, config, CONTEXT)
    one = decode_step_cost(config, 1, CONTEXT)
    print(f"  batch 1 is {roof.bound(one)}-bound: {one.intensity:.2f} FLOP/byte against a ridge of {roof.ridge:.1f}."
          f" The roof bends at batch {bend or 'never'}; past it every row adds its own FLOPs,\n  and tokens/s"
          f" levels off near {peak / per_token:,.0f}")
    for context in (1024, 8192):
        b = bend_batch(roof, config, context)
        print(f"  at context {context:,}: bends at batch {b}" if b else
              f"  at context {context:,}: never bends (the KV reads grow with the batch as fast as the FLOPs)")
    gpu, big = Roofline(**H100), as_config(LLAMA3_8B)
    print(f"  on an H100 (datasheet: ridge {gpu.ridge:.0f} FLOP/byte), Llama-3-8B in bf16 bends at batch"
          f" {bend_batch(gpu, big, CONTEXT, torch.bfloat16)} at context {CONTEXT};"
          f" at context 2,048: {bend_batch(gpu, big, 2048, torch.bfloat16) or 'never'}")
    # --8<-- [end:predict]
    if args.no_steps:
        return

    engine = decode_loop.DecodeLoopEngine(args.model, device=str(device))
    prompt = context_prompt(engine.tokenizer, CONTEXT)
    n_prompt, new = len(engine.tokenizer(prompt).input_ids), 16
    # --8<-- [start:points]
    hf_generate = super(decode_loop.DecodeLoopEngine, engine).generate   # Chapter 1's, on this very model
    points = [
        ("HF generate (04), batch 1", decode_step_cost(config, 1, n_prompt + new // 2),
         per_token_seconds(hf_generate, prompt, new, args.repeats, "HF generate")),
        ("our decode loop (07), batch 1", decode_step_cost(config, 1, n_prompt + new // 2),
         per_token_seconds(engine.generate, prompt, new, args.repeats, "decode loop")),
        *[(f"decode step (07), batch {b}", decode_step_cost(config, b, CONTEXT),
           step_seconds(engine, b, CONTEXT, args.repeats)) for b in BATCHES[1:]],
        (f"prefill of {CONTEXT} tokens (07)", prefill_cost(config, CONTEXT),
         step_seconds(engine, 1, CONTEXT, args.repeats, decode=False)),
    ]
    # --8<-- [end:points]
    print(f"\n[measured]  steps timed here, best of {args.repeats}; '% of roof': achieved FLOP/s over what the"
          f" roof allows at that intensity")
    print(f"  {'step':<32}{'ms':>8}{'floor ms':>10}{'FLOP/byte':>11}{'GFLOP/s':>9}{'% of roof':>11}")
    for label, cost, seconds in points:
        print(f"  {label:<32}{seconds * 1e3:>8.1f}{roof.floor_seconds(cost) * 1e3:>10.1f}{cost.intensity:>11.2f}"
              f"{cost.flops / seconds / 1e9:>9.1f}{cost.flops / seconds / roof.attainable(cost.intensity):>11.0%}")
    if args.plot:
        plot_roofline(roof, points, args.plot, f"{name}, float32, on {device_label(device)}",
                      {"bf16 matmul roof": bf16})


if __name__ == "__main__":
    main()
