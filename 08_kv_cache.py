"""08_kv_cache.py - what the KV cache buys, measured, and the work it saves, counted.

At every decode step the model needs the keys and values of *all* earlier tokens
to attend over them. There are two ways to get them:

    without a cache   re-run the whole sequence so far: step n costs a forward
                      pass over n tokens, so the total grows quadratically
    with a cache      keep each layer's keys and values from earlier steps and
                      feed only the one new token: every step costs about the same

This script decodes the same prompt both ways with greedy sampling, times every
step, checks that both produce the same tokens, counts the FLOPs each step must do,
fits a line to each path's step times and plots latency against position. What the
cache costs in memory is 08_kv_cache_sizes.py's subject.

    python 08_kv_cache.py
    python 08_kv_cache.py --steps 120 --plot results/kv_cache.png --json results/kv_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from kit import cli
from kit.hf import cache_keyword
from minivllm.model_files import load_hf_model, pick_device, resolve_model
from minivllm.roofline import forward_flops
from minivllm.sampling import greedy

DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived an"


# --8<-- [start:steps]
@torch.no_grad()
def step_with_cache(model, new_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Feed only the new token(s). Earlier keys/values come from `cache`, which grows in place."""
    cache_kw = cache_keyword(type(model))   # past_key_values, or cache in transformers 5
    out = model(input_ids=new_ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    return out.logits[0, -1]


@torch.no_grad()
def step_without_cache(model, all_ids: torch.Tensor) -> torch.Tensor:
    """Feed the whole sequence so far: every earlier key and value is computed again."""
    # logits_to_keep=1 in both steps: we only need the last position's scores, so the
    # difference we measure is the recomputed attention and MLPs, not the LM head.
    out = model(input_ids=all_ids, use_cache=False, logits_to_keep=1)
    return out.logits[0, -1]
# --8<-- [end:steps]


@dataclass
class DecodeRun:
    ids: torch.Tensor                                     # the whole sequence so far, [1, n]
    cache: DynamicCache | None = None                     # None: the no-cache path
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)   # tokens attended over at each step
    step_seconds: list[float] = field(default_factory=list)


# --8<-- [start:timed-decode]
def timed_step(model, run: DecodeRun, repeats: int = 1) -> None:
    """One greedy step, timed. With a cache, feed only what the cache has not seen yet:
    the whole prompt at the first step (the prefill), then one token per step.

    The step runs `repeats` times and the fastest time is kept: a busy machine can only
    add time, never remove it. Before a repeat, the cache drops what the previous try
    appended, so every try does exactly the same work.
    """
    seen = run.cache.get_seq_length() if run.cache is not None else 0
    best = float("inf")
    for attempt in range(repeats):
        if attempt and run.cache is not None:   # forget the previous try's keys and values
            if seen:   # a negative crop drops that many of the newest tokens
                run.cache.crop(seen - run.cache.get_seq_length())
            else:
                run.cache = DynamicCache()
        start = time.perf_counter()
        if run.cache is not None:
            logits = step_with_cache(model, run.ids[:, seen:], run.cache)
        else:
            logits = step_without_cache(model, run.ids)
        token = int(greedy(logits))  # int() waits for the device, so the time is real
        best = min(best, time.perf_counter() - start)
    run.step_seconds.append(best)
    run.positions.append(run.ids.shape[1])
    run.tokens.append(token)
    run.ids = torch.cat([run.ids, torch.tensor([[token]], device=run.ids.device)], dim=1)


def decode_both(model, prompt_ids: torch.Tensor, steps: int,
                repeats: int = 1) -> tuple[DecodeRun, DecodeRun]:
    """Greedy-decode `steps` tokens with and without the cache, in lockstep.

    Alternating one step of each means a busy machine slows both paths alike. EOS is
    ignored on purpose: we want the cost at every position, not a finished answer.
    """
    cached, uncached = DecodeRun(prompt_ids, DynamicCache()), DecodeRun(prompt_ids)
    for _ in range(steps):
        timed_step(model, cached, repeats)
        timed_step(model, uncached, repeats)
    return cached, uncached
# --8<-- [end:timed-decode]


# --8<-- [start:work]
def step_flops(config, position: int, with_cache: bool) -> int:
    """A decode step that makes the token after `position` tokens: with a cache, one new token
    over position - 1 cached ones; without, all `position` tokens from scratch."""
    return forward_flops(config, 1, position - 1) if with_cache else forward_flops(config, position, 0)
# --8<-- [end:work]


def window_median(run: DecodeRun, position: int, width: int = 5) -> float:
    """Median time of `width` consecutive decode steps around `position` (one alone is too noisy).

    Step 0 is the prefill and never counts; near the ends the window slides inward
    rather than shrinking, so every row is a median of the same number of steps.
    """
    i, n = run.positions.index(position), len(run.step_seconds)
    first = min(max(1, i - width // 2), max(1, n - width))
    return statistics.median(run.step_seconds[first: first + width])


# --8<-- [start:fit]
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the line through the points, Theil-Sen style: the median of the
    slopes between every pair of points. A busy machine's slow outliers barely move a median,
    where they would drag a least-squares fit."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    slope = statistics.median(slopes) if slopes else 0.0
    return statistics.median(y - slope * x for x, y in zip(xs, ys)), slope


def fit_description(intercept: float, slope: float) -> str:
    """The fitted line in words: a step's time at position 0 (seconds in), and what each token of
    context adds to it. A falling line says the machine got quieter during the run, not that
    context makes steps faster: it is printed with its sign, and said to be noise."""
    sign = "+" if slope >= 0 else "-"
    text = f"step = {intercept * 1e3:6.1f} ms {sign} {abs(slope) * 1e3:6.2f} ms per token of context"
    return text if slope >= 0 else text + " (falling: noise in the timings, not a trend)"


def predicted_seconds(fit: tuple[float, float], first: int, last: int) -> float:
    """The fitted step times summed over positions first..last: a line summed is a parabola."""
    intercept, slope = fit
    n = last - first + 1
    return n * intercept + slope * (first + last) * n / 2
# --8<-- [end:fit]


def plot(cached: DecodeRun, uncached: DecodeRun, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from itertools import accumulate

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label, color in ((uncached, "without cache", "tab:red"), (cached, "with KV cache", "tab:blue")):
        left.plot(run.positions, [s * 1e3 for s in run.step_seconds], label=label, color=color, lw=1)
        right.plot(run.positions, list(accumulate(run.step_seconds)), label=label, color=color)
    left.set(xlabel="position (tokens attended over)", ylabel="step latency (ms)", title="per step")
    right.set(xlabel="position (tokens attended over)", ylabel="cumulative time (s)", title="total so far")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description="Decode with and without the KV cache: time, work, growth.")
    cli.add_model_flags(parser)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--steps", type=cli.integer(1, 100_000), default=128, help="tokens to decode each way")
    parser.add_argument("--repeats", type=cli.integer(1, 100), default=2,
                        help="time each step this many times, keep the fastest")
    parser.add_argument("--plot", type=cli.plot_file(), default=None, help="save the latency plots here (png)")
    parser.add_argument("--json", type=cli.output_file(".json"), default=None, help="also write the measurements here")
    args = parser.parse_args()
    if not args.prompt:
        parser.error("--prompt must not be empty")
    try:
        device = pick_device(args.device)
        tokenizer, model = load_hf_model(args.model, device=device)
    except ValueError as exc:
        parser.error(str(exc))
    prompt_ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    context = model.config.max_position_embeddings
    if prompt_ids.shape[1] + max(args.steps, 3) > context:
        parser.error(f"the prompt ({prompt_ids.shape[1]} tokens) and --steps {args.steps} do not fit the "
                     f"model's context of {context} tokens")
    decode_both(model, prompt_ids, 3)  # warm-up: the first calls pay one-off costs
    cached, uncached = decode_both(model, prompt_ids, args.steps, args.repeats)
    same = cached.tokens == uncached.tokens
    print(f"[decode] prompt of {prompt_ids.shape[1]} tokens, {args.steps} greedy steps each way on {device.type}"
          f" (each step timed {args.repeats}x, fastest kept)")
    print(f"  same greedy tokens with and without the cache: {same}")
    print(f"  text: {tokenizer.decode(cached.tokens[:24])!r} ...")

    # --8<-- [start:table]
    config, width = model.config, min(5, max(1, args.steps - 1))
    print(f"\n[step latency and work]  prefill: one step; decode rows: median of {width} decode steps around"
          f" the position; work: FLOPs the step must do; total: the {args.steps - 1} decode steps summed")
    print(f"  {'position':>8}  {'with cache':>11}  {'without':>11}  {'ratio':>6}"
          f"  {'work with':>12}  {'without':>12}  {'ratio':>6}")

    def row(label, with_s, without_s, with_flops, without_flops, note=""):
        print(f"  {label:>8}  {with_s * 1e3:>8.1f} ms  {without_s * 1e3:>8.1f} ms  {without_s / with_s:>5.1f}x"
              f"  {with_flops / 1e9:>7.2f} GFLOP  {without_flops / 1e9:>7.2f} GFLOP"
              f"  {without_flops / with_flops:>5.1f}x{note}")

    n_prompt = prompt_ids.shape[1]
    prefill_flops = forward_flops(config, n_prompt, 0)
    row("prefill", cached.step_seconds[0], uncached.step_seconds[0], prefill_flops, prefill_flops,
        "   (the same work both ways: the whole prompt)")
    marks = sorted({p for p in (32, 64, 128, 192, 256) if p in cached.positions[1:]} | {cached.positions[-1]})
    for p in marks if args.steps > 1 else []:
        row(p, window_median(cached, p, width), window_median(uncached, p, width),
            step_flops(config, p, True), step_flops(config, p, False))
    decode = cached.positions[1:]
    if args.steps > 1:   # a sum carries every slow outlier that the medians above leave out
        work_c = sum(step_flops(config, p, True) for p in decode)
        work_u = sum(step_flops(config, p, False) for p in decode)
        total_c, total_u = sum(cached.step_seconds[1:]), sum(uncached.step_seconds[1:])
        print(f"  {'decode':>8}  {total_c:>9.2f} s  {total_u:>9.2f} s  {total_u / total_c:>5.1f}x"
              f"  {work_c / 1e9:>7.1f} GFLOP  {work_u / 1e9:>7.1f} GFLOP  {work_u / work_c:>5.1f}x   (total)")
        print(f"  arithmetic done per second: {work_c / total_c / 1e9:.1f} GFLOP/s with the cache,"
              f" {work_u / total_u / 1e9:.1f} GFLOP/s without")
    # --8<-- [end:table]
    if args.steps > 2:
        # --8<-- [start:growth]
        fit_c = fit_line(decode, cached.step_seconds[1:])
        fit_u = fit_line(decode, uncached.step_seconds[1:])
        print("\n[growth]  a line fitted to the decode steps' times (median of pairwise slopes)")
        for label, (intercept, slope) in (("with cache", fit_c), ("without", fit_u)):
            print(f"  {label:<11} {fit_description(intercept, slope)}")
        for answer in (256, 1024, 4096) if len(decode) >= 16 and min(fit_c[1], fit_u[1]) > 0 else ():
            last = n_prompt + answer - 1   # too few steps, or a slope below zero: too noisy to extrapolate
            if last <= context:
                with_s, without_s = (predicted_seconds(f, n_prompt + 1, last) for f in (fit_c, fit_u))
                print(f"  {answer:>5} tokens after this prompt, predicted: {with_s:8.1f} s with the cache,"
                      f" {without_s:8.1f} s without ({without_s / with_s:.0f}x)")
        # --8<-- [end:growth]

    if args.plot:
        plot(cached, uncached, Path(args.plot), f"{Path(resolve_model(args.model)).name} on {device.type}: "
             f"decode with vs without the KV cache")
        print(f"\nplot written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device.type, "prompt_tokens": prompt_ids.shape[1], "same_tokens": same,
            "with_cache": {"positions": cached.positions, "step_seconds": cached.step_seconds},
            "without_cache": {"positions": uncached.positions, "step_seconds": uncached.step_seconds},
            "with_cache_flops": [step_flops(model.config, p, True) for p in cached.positions[1:]],
            "without_cache_flops": [step_flops(model.config, p, False) for p in uncached.positions[1:]],
        }, indent=2))
        print(f"json written to {args.json}")


if __name__ == "__main__":
    main()
