"""13_continuous_batching_switches.py - Chapter 9: the assembled engine, its switches turned on one by one.

The continuous-batching engine composes every earlier chapter, and each feature is a
keyword of its constructor (and a flag of 05_server.py and of both benchmarks). This script
builds one engine per setting and runs the same traffic through each, in alternating rounds:

    float32                        Chapter 6's weights, Chapter 7's pool, Chapter 9's scheduler
    + prefix caching               Chapter 8: a prompt's cached prefix is shared, not recomputed
    int8 / int4 weights            Chapter 12: fewer bytes read per step, with and without the cache

The traffic is Chapter 9's mixed workload (32 requests of committed lengths, all at once),
each prompt behind the same system text, as a chat service sends them: that shared
beginning is what prefix caching exists for. `--no-system` drops it.

    python 13_continuous_batching_switches.py                  # the table (about 15 minutes on 2 cores)
    python 13_continuous_batching_switches.py --plot ch9-switches.png --requests 16 --rounds 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

from kit import bench, cli, progress, workloads
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.threads import thread_count

offline = importlib.import_module("06_benchmark_offline")

# --8<-- [start:settings]
SETTINGS = [   # (label, constructor keywords): each row turns one more switch, or swaps the weights
    ("float32", {}),
    ("float32 + prefix caching", {"prefix_caching": True}),
    ("int8", {"quant": "int8"}),
    ("int8 + prefix caching", {"quant": "int8", "prefix_caching": True}),
    ("int4", {"quant": "int4"}),
    ("int4 + prefix caching", {"quant": "int4", "prefix_caching": True}),
]
# --8<-- [end:settings]


def traffic(tokenizer, n: int, system: bool) -> list[workloads.WorkItem]:
    """The mixed workload; with `system`, every prompt follows the same system text."""
    items = workloads.mixed_workload(tokenizer, n)
    if not system:
        return items
    text = json.loads((workloads.REPO_ROOT / "data" / "prefix_cache_workload.json").read_text())["system"]
    return [workloads.WorkItem(f"{text}\n\n{it.prompt}", it.max_new_tokens) for it in items]


# --8<-- [start:run]
def run_once(engine, items: list, params) -> tuple[list, float, list]:
    """Every request handed to the engine loop at once; (records, seconds until the last is done, results)."""
    engine.reset_prefix_cache()                       # every run starts cold: no round helps the next
    t0 = time.perf_counter()
    streams = [engine.submit(it.prompt, it.max_new_tokens, params) for it in items]
    results = [s.result() for s in streams]           # the engine finishes each in its own time
    seconds = time.perf_counter() - t0
    records = [offline.record_of(r, r.metrics.output_tokens / r.metrics.throughput) for r in results]
    return records, seconds, results


def run_settings(engines: dict, items: list, rounds: int) -> dict:
    """Alternating rounds (forward, then backward) of the same requests through every engine."""
    params = SamplingParams(ignore_eos=True)
    records, seconds, cached = {k: [] for k in engines}, dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    outputs = {}
    estimate = 0.0
    for label, engine in engines.items():             # warm-up: first calls allocate
        progress.say(f"[warm-up] {label}: 2 requests, not counted")
        recs, secs, _ = run_once(engine, items[:2], params)
        # The warm-up's pace per output token, over every round's tokens: an upper bound, since
        # 32 requests at once share each step where the warm-up's two shared it less.
        estimate += secs / sum(r.output_tokens for r in recs) * sum(it.max_new_tokens for it in items) * rounds
    progress.say(f"[plan] {rounds} round(s) x {len(engines)} engines x {len(items)} requests: at most about "
                 f"{progress.duration(estimate)} at the warm-up's pace")
    order = list(engines)
    with progress.Progress(rounds * len(engines), "engine runs", "switches") as bar:
        for r in range(rounds):
            for label in order if r % 2 == 0 else order[::-1]:
                recs, secs, results = run_once(engines[label], items, params)
                bar.update(1, note=f"round {r + 1}: {label}, {secs:.0f} s")
                records[label] += recs
                seconds[label] += secs
                cached[label] += sum(res.metrics.cached_tokens or 0 for res in results)
                outputs[label] = [res.output_ids for res in results]
    return {"stats": {k: bench.bench_stats(k, records[k], seconds[k]) for k in engines},
            "cached": {k: cached[k] / rounds for k in engines}, "outputs": outputs}
# --8<-- [end:run]


def shared_features(features: list[dict]) -> tuple[dict, list[str]]:
    """What every engine has in common, and the names of the features that differ between them:
    printing the first engine's features as everyone's would call the int8 engine float32."""
    if not features:
        raise ValueError("no engines")
    keys = list(dict.fromkeys(k for f in features for k in f))
    differing = [k for k in keys if any(f.get(k) != features[0].get(k) for f in features)]
    return {k: v for k, v in features[0].items() if k not in differing}, differing


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose whole greedy output is the same token for token."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def print_table(result: dict, items: list, tokenizer) -> None:
    stats, first = result["stats"], next(iter(result["stats"]))
    prompt_tokens = sum(len(tokenizer(it.prompt).input_ids) for it in items)
    print(f"\n[{len(items)} requests at once, {prompt_tokens:,} prompt tokens, "
          f"{stats[first].output_tokens // max(1, stats[first].requests // len(items)):,} output tokens a round]")
    print(f"  {'setting':<26}{'output tok/s':>13}{'x float32':>10}{'TTFT p50 ms':>13}"
          f"{'prompt tokens cached':>22}{'same answers as float32':>25}")
    for label, st in stats.items():
        print(f"  {label:<26}{st.output_tokens_per_s:>13.1f}{st.output_tokens_per_s / stats[first].output_tokens_per_s:>10.2f}"
              f"{st.ttft_ms['p50']:>13.0f}{result['cached'][label] / prompt_tokens:>22.0%}"
              f"{agreement(result['outputs'][label], result['outputs'][first]):>25.0%}")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = result["stats"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = list(stats)[::-1]
    left.barh(labels, [stats[k].output_tokens_per_s for k in labels], color="#4c6ef5")
    left.set(xlabel="output tokens/s (all requests at once)", title="throughput")
    right.barh(labels, [stats[k].ttft_ms["p50"] for k in labels], color="#e8590c")
    right.set(xlabel="median time to first token, ms", title="TTFT")
    right.set_yticklabels([])
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[plot] {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 9: the assembled engine's switches, one by one.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--requests", type=cli.integer(2, 64), default=32)
    parser.add_argument("--rounds", type=cli.integer(1, 20), default=2, help="alternating rounds")
    parser.add_argument("--no-system", action="store_true", help="the mixed workload alone, no shared system text")
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), default=None)
    args = parser.parse_args()
    try:
        engines = {label: LLM(args.model, device=args.device, **kw)
                   for label, kw in SETTINGS}
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    tokenizer = next(iter(engines.values())).tokenizer
    items = traffic(tokenizer, args.requests, not args.no_system)
    common, differing = shared_features([e.features() for e in engines.values()])
    print(f"[settings] {len(engines)} engines, {args.rounds} alternating round(s), {thread_count()}; "
          f"every engine: {common}; set per engine (the rows below): {', '.join(differing)}")
    result = run_settings(engines, items, args.rounds)
    for engine in engines.values():
        engine.close()
    print_table(result, items, tokenizer)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
