"""09_static_batching.py - Chapter 5: run many prompts through one decode loop at once.

`generate_batch` has so far been a loop over single requests. At batch size 1 each
decode step reads every weight of the model to produce one token: the hardware
mostly waits on memory. A batch of B rows reads the weights once for B tokens.

Static batching reuses Chapter 2's loop unchanged, on [batch, seq] tensors:

    left padding   prompts have different lengths; pad on the left so that every
                   row's newest token sits in the last column, and mask the pads out
    position ids   count only real tokens, so a padded row's RoPE positions are the
                   ones it would have alone
    per-row stop   a row that hits EOS or a stop string is done; it keeps riding
                   along (static!) until the longest row finishes

Sampling: every row gets its own generator seeded with params.seed, the *same* seed
for every row, so a prompt's sampled output does not depend on its batch mates and
equals `generate(prompt)` alone with the same params, just as with the sequential
baseline.

    python 09_static_batching.py                       # the batch-size sweep
    python 09_static_batching.py --sizes 1 4 16 --max-new-tokens 16 --plot sweep.png --json sweep.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from statistics import median

import torch

from kit import cli, progress
from kit.workloads import reference_prompts
from minivllm.contracts import GenerateResult, SamplingParams, check_prompts

decode_loop = importlib.import_module("07_decode_loop")


class StaticBatchEngine(decode_loop.DecodeLoopEngine):
    """Chapter 5: generate_batch runs up to max_batch_size prompts through one decode loop."""

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, max_batch_size: int = 32, structured_output=None):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        super().__init__(model_name, device, dtype, structured_output)
        self.max_batch_size = max_batch_size
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)  # never attended anyway

    def capabilities(self):
        """Chapter 2's engine, and a list's prompts max_batch_size at a time (the server batches by it)."""
        return super().capabilities().replace(max_batch_size=self.max_batch_size)

    # --8<-- [start:left-pad]
    def left_pad(self, prompts: list[torch.Tensor]):
        """Stack [1, n_i] prompts into [batch, width] input_ids, attention mask and position ids."""
        width = max(p.shape[1] for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long, device=self.device)
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):
            input_ids[row, width - p.shape[1]:] = p[0]
            attention_mask[row, width - p.shape[1]:] = 1
        # Position = number of real tokens before this one; pads get 0 (they are masked anyway).
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        if bool(attention_mask.all()):
            attention_mask = None   # equal lengths: plain causal attention, the fast path
        return input_ids, attention_mask, position_ids
    # --8<-- [end:left-pad]

    # --8<-- [start:generate-batch]
    def generate_batch(self, prompts: list[str], max_new_tokens: int,
                       params: SamplingParams | None = None) -> list[GenerateResult]:
        check_prompts(prompts)
        t0 = time.perf_counter()           # every request was submitted now: TTFT counts from here
        params = SamplingParams.or_default(params)
        budget = params.token_budget(max_new_tokens)
        encoded = [self.encode(p, budget) for p in prompts]   # refuse bad input before any work
        results = []
        for start in range(0, len(encoded), self.max_batch_size):
            chunk = encoded[start: start + self.max_batch_size]
            requests = [self.output.new_request(ids[0].tolist(), params, budget, arrival=t0) for ids in chunk]
            for _ in self.decode_loop(*self.left_pad(chunk), requests):
                pass                       # per-row stopping happens inside the loop (accept)
            # Each row reports its own ids, finish_reason and timings (its last token's time).
            results += [self.output.result(r) for r in requests]
        return results
    # --8<-- [end:generate-batch]

    def generate(self, prompt: str, max_new_tokens: int,
                 params: SamplingParams | None = None) -> GenerateResult:
        return self.generate_batch([prompt], max_new_tokens, params)[0]


def padding_waste(lengths: list[int], new_tokens: int) -> tuple[float, float]:
    """Share of positions that were padding: in prefill, and among the keys read while decoding."""
    width, rows = max(lengths), len(lengths)
    pads = sum(width - n for n in lengths)
    prefill = pads / (rows * width)
    steps = range(1, new_tokens)       # decode step t reads width + t keys per row
    decode = pads * len(steps) / max(1, sum(rows * (width + t) for t in steps))
    return prefill, decode


# --8<-- [start:sweep]
def measure(engine: StaticBatchEngine, prompts: list[str], new_tokens: int, params: SamplingParams,
            batched: bool) -> dict:
    """One timed run of the whole list: throughput and mean request latency."""
    t = time.perf_counter()
    if batched:
        results = engine.generate_batch(prompts, new_tokens, params)
    else:   # Chapter 2's engine keeps Chapter 1's generate_batch: one request after another, same model
        results = decode_loop.DecodeLoopEngine.generate_batch(engine, prompts, new_tokens, params)
    elapsed = time.perf_counter() - t
    own = [r.metrics.output_tokens / r.metrics.throughput for r in results]   # each request's own time
    # Batched, every request runs for the whole batch; sequential, request i also waits for the i before it.
    done = own if batched else [sum(own[: i + 1]) for i in range(len(own))]
    return {"tokens_per_s": sum(r.metrics.output_tokens for r in results) / elapsed,
            "latency_s": sum(done) / len(done), "results": results}


def sweep(engine: StaticBatchEngine, sizes: list[int], new_tokens: int, repeats: int = 2,
          bar=None) -> list[dict]:
    """Throughput and latency against batch size, next to the sequential baseline (same model).

    Each size runs `repeats` rounds of both ways, alternating which goes first, so a busy
    moment on the machine hits both; the table gives medians and the range of the ratio.
    `bar` (kit.progress) hears of every timed pass: the largest sizes take minutes.
    """
    pool = reference_prompts()                # mixed lengths on purpose: padding is part of the cost
    params = SamplingParams(ignore_eos=True)  # every row produces exactly new_tokens
    engine.generate_batch(pool[:2], 2, params)  # warm-up
    table = []
    for size in sizes:
        prompts = [pool[i % len(pool)] for i in range(size)]
        rounds = []
        for r in range(repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            passes = {}
            for batched in order:
                passes[batched] = measure(engine, prompts, new_tokens, params, batched)
                if bar:
                    bar.update(size, note=f"batch {size}, round {r + 1}, {'batched' if batched else 'sequential'}")
            rounds.append(passes)
        ratios = [x[True]["tokens_per_s"] / x[False]["tokens_per_s"] for x in rounds]
        ours = rounds[-1][True]["results"]
        prefill_pad, decode_pad = padding_waste([r.metrics.input_tokens for r in ours], new_tokens)
        table.append({
            "batch": size, "repeats": repeats,
            "tokens_per_s": median([x[True]["tokens_per_s"] for x in rounds]),
            "baseline_tokens_per_s": median([x[False]["tokens_per_s"] for x in rounds]),
            "ratio": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "latency_s": median([x[True]["latency_s"] for x in rounds]),
            "baseline_latency_s": median([x[False]["latency_s"] for x in rounds]),
            "ttft_ms": median([sum(r.metrics.ttft_ms for r in x[True]["results"]) / size for x in rounds]),
            "tpot_ms": median([sum(r.metrics.tpot_ms or 0.0 for r in x[True]["results"]) / size for x in rounds]),
            "prefill_padding": prefill_pad, "decode_padding": decode_pad,
        })
        (bar.print if bar else print)(row_text(table[-1]))   # through the bar: never over its line
    return table
# --8<-- [end:sweep]


HEADER = (f"{'batch':>5} {'tok/s':>8} {'seq tok/s':>9} {'ratio':>6} {'(range)':>11} {'latency s':>9} "
          f"{'seq lat s':>9} {'TTFT ms':>8} {'TPOT ms':>8} {'pad prefill':>11} {'pad decode':>10}")


def row_text(r: dict) -> str:
    spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
    return (f"{r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['baseline_tokens_per_s']:>9.1f} {r['ratio']:>6.2f} "
          f"{spread:>11} {r['latency_s']:>9.2f} {r['baseline_latency_s']:>9.2f} {r['ttft_ms']:>8.0f} "
          f"{r['tpot_ms']:>8.1f} {r['prefill_padding']:>11.0%} {r['decode_padding']:>10.0%}")


def plot(table: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt

    sizes = [r["batch"] for r in table]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [r["tokens_per_s"] for r in table], "o-", label="static batching")
    left.plot(sizes, [r["baseline_tokens_per_s"] for r in table], "s--", label="sequential baseline")
    left.set(xscale="log", xlabel="batch size", ylabel="output tokens/s", title="Throughput")
    right.plot(sizes, [r["latency_s"] for r in table], "o-", label="static batching")
    right.plot(sizes, [r["baseline_latency_s"] for r in table], "s--", label="sequential baseline")
    right.set(xscale="log", xlabel="batch size", ylabel="mean request latency (s)", title="Latency")
    for ax in (left, right):
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[plot] {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 5: static batching, measured against batch size.")
    cli.add_model_flags(parser)
    parser.add_argument("--sizes", type=cli.integer(1, 256), nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--max-new-tokens", type=cli.integer(1, 100_000), default=32)
    parser.add_argument("--repeats", type=cli.integer(1, 100), default=2,
                        help="rounds per size, alternating which way goes first")
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), default=None,
                        help="save throughput/latency plots here")
    parser.add_argument("--json", metavar="PATH", type=cli.output_file(".json"), default=None,
                        help="save the table as JSON here")
    args = parser.parse_args()
    try:
        engine = StaticBatchEngine(args.model, device=args.device, max_batch_size=max(args.sizes))
        for prompt in reference_prompts():    # every prompt with its budget fits, or say so now
            engine.encode(prompt, args.max_new_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    # Said before the sweep starts: one request timed alone, times the requests run one by one,
    # is the sequential passes' length; the batched passes take less than that again.
    t0 = time.perf_counter()
    engine.generate(reference_prompts()[0], args.max_new_tokens, SamplingParams(ignore_eos=True))
    one_s = time.perf_counter() - t0
    progress.say(f"[plan] {len(args.sizes)} batch sizes x {args.repeats} round(s), sequential and batched: at most "
                 f"about {progress.duration(2 * one_s * sum(args.sizes) * args.repeats)} (one request took {one_s:.1f} s)")
    print(f"\n[Static batching vs sequential generate, {args.max_new_tokens} new tokens, ignore_eos, reference "
          f"prompts cycled; medians of {args.repeats} alternating rounds, (range) = the rounds' lowest-highest ratio]"
          f"\n{HEADER}", flush=True)
    with progress.Progress(2 * sum(args.sizes) * args.repeats, "requests", "sweep") as bar:
        table = sweep(engine, args.sizes, args.max_new_tokens, args.repeats, bar)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(engine.device), "max_new_tokens": args.max_new_tokens, "rows": table}, f,
                      indent=2)
        print(f"[json] {args.json}")
    if args.plot:
        plot(table, args.plot)


if __name__ == "__main__":
    main()
