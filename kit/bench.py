"""kit/bench.py - what both benchmarks share: their flags, their statistics, their table, plot and JSON.

06_benchmark_offline.py times engines in-process and 06_benchmark_online.py times servers over
HTTP; everything after the measurement is one code path, so the two print comparable numbers.
Later chapters' demos summarise their own timings with `summarize` for the same reason.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kit import cli
from kit.workloads import PROMPTS_PATH


# --8<-- [start:bench-stats]
@dataclass
class RequestRecord:
    """What one request cost, as measured (latency) or as the engine reported (tokens, TTFT, TPOT)."""

    latency_ms: float
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)  # gaps between streamed tokens (online only)
    error: str | None = None                             # a failed request counts, but not in latencies
    beyond_budget: int = 0   # static batch: tokens generated past this request's own budget (not counted)


@dataclass
class BenchStats:
    """One engine on one workload. Distributions are dicts: mean, p50, p90, p99 (milliseconds)."""

    name: str
    requests: int            # completed requests
    failed: int
    duration_s: float        # wall time of the measured runs
    input_tokens: int
    output_tokens: int       # counted by the engine, not assumed from max_new_tokens
    requests_per_s: float
    output_tokens_per_s: float
    latency_ms: dict | None  # wall time per request
    ttft_ms: dict | None = None   # only when the engine (or the client) measured it
    tpot_ms: dict | None = None
    itl_ms: dict | None = None
# --8<-- [end:bench-stats]


# --8<-- [start:summarize]
def summarize(values) -> dict | None:
    """Mean and tail of a distribution; None when nothing was measured (the line is then omitted)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    # numpy's default percentile interpolates linearly between the two nearest ranks.
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def bench_stats(name: str, records: list[RequestRecord], duration_s: float) -> BenchStats:
    """Add up the records of one measured run lasting duration_s seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    return BenchStats(
        name=name, requests=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        input_tokens=sum(r.input_tokens for r in ok), output_tokens=out_tokens,
        requests_per_s=len(ok) / duration_s, output_tokens_per_s=out_tokens / duration_s,
        latency_ms=summarize(r.latency_ms for r in ok),
        ttft_ms=summarize(r.ttft_ms for r in ok), tpot_ms=summarize(r.tpot_ms for r in ok),
        itl_ms=summarize(gap for r in ok for gap in r.itl_ms))
# --8<-- [end:summarize]


def engine_labels(specs: list[str]) -> list[str]:
    """Short column names: the class, with the spec's own flags ('BaselineEngine', 'QuantizedEngine
    --quant int4'); a repeated engine becomes 'BaselineEngine#2'."""
    labels, seen = [], {}
    for spec in specs:
        class_spec, *flags = spec.split(None, 1) or [spec]
        base = " ".join([class_spec.rpartition(":")[2] or class_spec, *flags])
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return labels


def stat_rows(stats: BenchStats) -> dict[str, float | int | None]:
    """The table's lines for one engine, in the book's order; None where nothing was measured."""
    rows = {"requests": stats.requests, "failed": stats.failed, "input_tokens": stats.input_tokens,
            "output_tokens": stats.output_tokens, "duration_s": stats.duration_s,
            "requests/s": stats.requests_per_s, "output_tokens/s": stats.output_tokens_per_s}
    for name in ("latency_ms", "ttft_ms", "tpot_ms", "itl_ms"):
        for key in ("mean", "p50", "p90", "p99"):
            rows[f"{name} {key}"] = (getattr(stats, name) or {}).get(key)
    return rows


def fmt(value) -> str:
    """Counts as they are, small rates with two decimals, everything else with one."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


# What every line of the table means, with its unit: printed under it, for the lines it shows.
LEGEND = {
    "requests": "requests completed (count)",
    "failed": "requests that ended in an error (count; left out of the time lines)",
    "input_tokens": "prompt tokens of the completed requests (count)",
    "output_tokens": "generated tokens within each request's own budget (count)",
    "duration_s": "seconds of wall time, from submitting a run's requests to the last answer, over all runs",
    "requests/s": "completed requests per second of duration_s",
    "output_tokens/s": "output tokens per second of duration_s",
    "latency_ms": "ms from a request's submission to its last token, time queued behind others included",
    "ttft_ms": "ms from a request's submission to its first token",
    "tpot_ms": "ms per output token after the first, averaged within each request",
    "itl_ms": "ms between two consecutive streamed tokens",
}


def legend_lines(rows: list[str], submitted: str) -> list[str]:
    """The legend of the rows shown: each once (latency_ms for its four summaries), then when the
    clock of the *_ms lines starts, which differs by benchmark (`submitted`)."""
    names = list(dict.fromkeys(row.split(" ")[0] for row in rows))
    unknown = [n for n in names if n not in LEGEND]
    if unknown:
        raise ValueError(f"no legend for table line(s) {unknown}: add them to LEGEND")
    lines = [f"  {name:<18} {LEGEND[name]}" for name in names]
    if any(name.endswith("_ms") for name in names):
        lines.append(f"  {'*_ms mean/pNN':<18} over requests: mean, median (p50), 90th and 99th percentiles")
        lines.append(f"  {'submission':<18} {submitted}")
    return lines


def print_table(title: str, all_stats: list[BenchStats], submitted: str) -> None:
    """Aligned 'name  value' lines; with several engines, side by side with the ratio to the first.
    Under it, the legend of the lines shown; `submitted` says when a request's clock starts."""
    print(f"\n[{title}]")
    columns = [stat_rows(s) for s in all_stats]
    widths = [max(22, len(s.name) + 2) for s in all_stats]   # a long engine name must not run into the next
    if len(all_stats) > 1:
        print(f"  {'':<18} " + "".join(f"{s.name:<{w}}" for s, w in zip(all_stats, widths)).rstrip())
    shown = []
    for name in columns[0]:
        if all(col[name] is None for col in columns):
            continue  # e.g. TTFT for an engine that cannot see its own loop
        shown.append(name)
        cells = []
        for col, width in zip(columns, widths):
            value, first = col[name], columns[0][name]
            cell = fmt(value)
            if col is not columns[0] and value is not None and first and name not in ("requests", "failed"):
                cell += f" ({value / first:.2f}x)"
            cells.append(f"{cell:<{width}}")
        print(f"  {name:<18} " + "".join(cells).rstrip())
    print("  where")
    print("\n".join(legend_lines(shown, submitted)))
    if len(all_stats) > 1:
        print(f"  (Nx) = ratio to {all_stats[0].name}: above 1 is better for the /s lines, "
              "below 1 for duration_s and the *_ms lines")


def plot_results(path: str | Path, all_stats: list[BenchStats], all_records: list[list], title: str) -> None:
    """Per-request latency (and TTFT, where measured) as box plots per engine, next to throughput."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed: write a file
    import matplotlib.pyplot as plt

    names = [s.name for s in all_stats]
    panels = [("Latency per request", "latency_ms")]
    if any(s.ttft_ms for s in all_stats):
        panels.append(("Time to first token", "ttft_ms"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5.5 * (len(panels) + 1), 4.2))
    for ax, (label, key) in zip(axes, panels):
        data = [[getattr(r, key) for r in recs if r.error is None and getattr(r, key) is not None] or [np.nan]
                for recs in all_records]
        ax.boxplot(data, whis=(1, 99), showmeans=True)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=10)
        ax.set(title=f"{label} (whiskers p1-p99)", ylabel="ms")
    bars = axes[-1].bar(names, [s.output_tokens_per_s for s in all_stats], color="tab:orange")
    axes[-1].bar_label(bars, fmt="%.1f")
    axes[-1].set(title="Output throughput", ylabel="tokens/s")
    axes[-1].tick_params(axis="x", rotation=10)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str | Path, config: dict, all_stats: list[BenchStats], all_records: list[list]) -> None:
    results = [{"stats": asdict(s), "requests": [asdict(r) for r in recs]} for s, recs in zip(all_stats, all_records)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"config": config, "results": results}, indent=2))


def common_args(parser: argparse.ArgumentParser, table: bool = False) -> None:
    """The flags both benchmarks share, so the two are run the same way. `table`: offer Chapter 13's
    speed table too, which only the offline benchmark runs (kit/suite.py)."""
    parser.add_argument("--engine", action="append", help="module:Class; repeat it to compare engines "
                        "(default: 04_engine:BaselineEngine). The engine flags below go to every engine; "
                        "flags after the class, in the same quotes, are that engine's alone and win: "
                        "--engine \"16_quantization_engine:QuantizedEngine --quant int4\"")
    parser.add_argument("--model", default=None, help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workload", choices=("prompts", "mixed") + (("table",) if table else ()), default="prompts",
                        help="prompts: the committed prompt set, one budget (--max-new-tokens); mixed: "
                        "data/mixed_workload.json's prompt lengths and per-request budgets"
                        + ("; table: batch 1, prefill, batch 32 and mixed in one table of tokens/s" if table else ""))
    parser.add_argument("--prompts", default=str(PROMPTS_PATH), help="benchmark prompt file")
    parser.add_argument("--num-prompts", type=cli.integer(1, 10_000), default=None,
                        help="use only the first N prompts (mixed: N requests, default 32)")
    parser.add_argument("--max-new-tokens", type=cli.integer(1, 100_000), default=None,
                        help="budget of every request (default 32; the mixed workload brings its own)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the whole budget (equal work)")
    parser.add_argument("--seed", type=cli.integer(0, 2**32 - 1), default=0,
                        help="which text each mixed prompt gets; online, also the arrival schedule")
    parser.add_argument("--warmup", type=cli.integer(0, 1000), default=2, help="requests run first and discarded")
    parser.add_argument("--json", type=cli.output_file(".json"), default=None, help="write the full results here")
    parser.add_argument("--plot", type=cli.plot_file(), default=None, help="write a PNG of latency and throughput here")
    # The same switches as 05_server.py's, so a feature is measured exactly as it is served.
    cli.add_engine_options(parser)


def check_common(parser: argparse.ArgumentParser, args) -> None:
    """Refuse flag combinations that would measure something else than asked; fill the defaults."""
    if args.workload == "mixed" and args.max_new_tokens is not None:
        parser.error("--workload mixed gives every request its own budget: drop --max-new-tokens")
    if args.workload == "mixed" and args.prompts != str(PROMPTS_PATH):
        parser.error("--workload mixed builds its prompts from data/: drop --prompts")
    if not args.prompts:
        parser.error("--prompts needs a file name")
    if args.max_new_tokens is None and args.workload == "prompts":
        args.max_new_tokens = 32


def save_outputs(args, config: dict, all_stats: list[BenchStats], all_records: list[list], title: str) -> None:
    """--json and --plot, written the same way by both benchmarks."""
    if args.json:
        write_json(args.json, config, all_stats, all_records)
        print(f"\n[saved] {args.json}")
    if args.plot:
        plot_results(args.plot, all_stats, all_records, title)
        print(f"[saved] {args.plot}")
