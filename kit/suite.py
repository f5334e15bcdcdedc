"""kit/suite.py - the speed table: four workloads in one command, one row per engine, vLLM's last.

    python 06_benchmark_offline.py --workload table --ignore-eos --runs 1 \\
        --engine 04_engine:BaselineEngine --engine minivllm:LLM \\
        --engine 17_compile:CompiledEngine --batch BaselineEngine --peer vllm

One number rarely says where an engine stands: batch 1 is decode alone (every weight read for
each token), prefill is one long prompt's forward pass, batch 32 is decode with the weights
shared by 32 requests, and the mixed workload is all of it with uneven budgets. The benchmark
measures each workload as it measures any other (06_benchmark_offline.py's `measure`, engines
and peer alternating run by run); this module builds the four workloads, reads one rate from
each result and prints them side by side, with every engine's ratio to vLLM and to the first
engine named. A single workload's report (--workload prompts or mixed) is here too, so that the
benchmark script keeps the measuring and this module everything said after it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from kit import bench, peers, workloads
from kit.bench import BenchStats, fmt
from kit.workloads import WorkItem


@dataclass
class Measured:
    """One workload measured: a row per engine (the peer's last, when it ran), each row's records,
    how each engine met the requests, and the requests themselves (the first engine's)."""

    labels: list[str]
    stats: list[BenchStats]
    records: list[list]
    modes: list[str]
    items: list[WorkItem]


@dataclass(frozen=True)
class Column:
    """One workload of the table: its name in the table, its requests, and which tokens its rate counts."""

    key: str
    header: str
    build: Callable[[object, int], list[WorkItem]]   # (tokenizer, seed) -> requests
    meaning: str
    prompt_rate: bool = False   # prefill makes one token: its work is the prompt's, so count those


COLUMNS = (
    Column("batch_1", "batch 1", lambda tok, seed: workloads.single_workload(tok, seed),
           f"output tokens/s, 1 request of {workloads.TABLE_NEW_TOKENS} new tokens"),
    Column("prefill", f"prefill {workloads.PREFILL_TOKENS} tok", lambda tok, seed: workloads.prefill_workload(tok),
           f"prompt tokens/s, 1 plain-text prompt of {workloads.PREFILL_TOKENS} tokens, 1 new token",
           prompt_rate=True),
    Column("batch_32", "batch 32", lambda tok, seed: workloads.batch_workload(tok, 32, seed),
           f"output tokens/s, 32 requests of {workloads.TABLE_NEW_TOKENS} new tokens, handed over at once"),
    Column("mixed_32", "mixed 32", lambda tok, seed: workloads.mixed_workload(tok, 32, seed),
           "output tokens/s, the mixed workload's 32 requests, each with its own budget"),
)


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse what would change the table's workloads, so that every table measures the same ones."""
    if args.workload != "table":
        return
    given = [flag for flag, set_ in (("--num-prompts", args.num_prompts is not None),
                                     ("--max-new-tokens", args.max_new_tokens is not None),
                                     ("--batch-size", args.batch_size is not None),
                                     ("--prompts", args.prompts != str(workloads.PROMPTS_PATH))) if set_]
    if given:
        parser.error(f"--workload table fixes every workload's requests, sizes and budgets: drop {', '.join(given)}")
    if getattr(args, "prefix_caching", None):
        parser.error("--workload table repeats each prompt (warm-up, runs): with --prefix-caching the "
                     "prefill column would time a cache hit, not a prefill; drop --prefix-caching")
    if not args.ignore_eos:
        parser.error("--workload table: its columns are defined by their budgets (an early end of text "
                     "would make less work); add --ignore-eos")


def unit(column: Column) -> str:
    return "prompt tokens/s" if column.prompt_rate else "output tokens/s"


def rate(stats: BenchStats, column: Column) -> float:
    return stats.input_tokens / stats.duration_s if column.prompt_rate else stats.output_tokens_per_s


def summarize(measured: dict[str, Measured], peer_name: str | None) -> dict:
    """The table as data: rows[name][column key] in tokens/s (None where a row did not run, e.g.
    a peer that failed), then each row's ratios to vLLM and to the first engine (above 1: faster)."""
    rows: dict[str, dict] = {}
    for column in COLUMNS:
        for stats in measured[column.key].stats:
            rows.setdefault(stats.name, {c.key: None for c in COLUMNS})[column.key] = rate(stats, column)
    names = [n for n in rows if n != peer_name] + ([peer_name] if peer_name in rows else [])

    def ratios(name: str, against: str) -> dict:
        return {c.key: (rows[name][c.key] / rows[against][c.key]
                        if rows[name][c.key] and rows[against][c.key] else None) for c in COLUMNS}
    first = names[0]
    return {"columns": {c.key: {"header": c.header, "meaning": c.meaning, "unit": unit(c)} for c in COLUMNS},
            "rows": {n: rows[n] for n in names},
            "vs_peer": {n: ratios(n, peer_name) for n in names if n != peer_name} if peer_name in rows else {},
            "vs_first": {first: {n: ratios(n, first) for n in names[1:]}}}


def workload_line(column: Column, m: Measured, runs: int) -> str:
    """One line per workload, said as it ends: each engine's seconds and how it met the requests."""
    engines = ", ".join(f"{s.name} {fmt(s.duration_s)} s ({mode})" for s, mode in zip(m.stats, m.modes))
    requests = f"{len(m.items)} request{'s' if len(m.items) > 1 else ''}"
    return f"[{column.header}] {requests} x {runs_said(runs)}, {budget_said(m.items)}: {engines}"


def budget_said(items: list[WorkItem]) -> str:
    budgets = sorted({w.max_new_tokens for w in items})
    return f"max_new_tokens={budgets[0]}" if len(budgets) == 1 else f"own budgets {', '.join(map(str, budgets))}"


def runs_said(runs: int) -> str:
    return f"{runs} run{'s' if runs > 1 else ''}"


def report(m: Measured, args, config: dict, peer_name: str | None, submitted: str) -> str:
    """One workload's detailed table (--workload prompts or mixed), vLLM's ratios, --json and --plot.
    Returns how the engines met the requests, as the title says it."""
    mode = m.modes[0] if len(set(m.modes)) == 1 else ", ".join(f"{lb} {md}" for lb, md in zip(m.labels, m.modes))
    title = (f"Offline benchmark: {len(m.items)} {'mixed requests' if args.workload == 'mixed' else 'prompts'}"
             f" x {args.runs} runs, {mode}, {budget_said(m.items)}{', ignore_eos' if args.ignore_eos else ''}")
    bench.print_table(title, m.stats, submitted)
    if peer_name and m.labels[-1] == peer_name:
        print("\n".join(peers.ratio_lines(m.stats, peer_name)))
    for line in beyond_budget_lines(m):
        print(line)
    bench.save_outputs(args, {**config, "mode": mode}, m.stats, m.records, title)
    return mode


def beyond_budget_lines(m: Measured) -> list[str]:
    """What a static batch generated past its own requests' budgets: not counted, but waited for."""
    return [f"  [{stats.name}] static batches run to their largest budget: {beyond} tokens generated "
            f"past their own request's budget were not counted, but every request waited for them"
            for stats, recs in zip(m.stats, m.records) if (beyond := sum(r.beyond_budget for r in recs))]


def summary_lines(summary: dict, runs: int) -> list[str]:
    headers = [c["header"] for c in summary["columns"].values()]
    width = max(len(n) for n in [*summary["rows"], "ours / vLLM"]) + 2
    widths = [max(12, len(h) + 2) for h in headers]

    def line(name: str, cells) -> str:
        return f"  {name:<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
    lines = [f"\n[Speed table: tokens/s, {runs_said(runs)} per workload, ignore_eos]", line("engine", headers)]
    lines += [line(n, [fmt(v) for v in row.values()]) for n, row in summary["rows"].items()]
    ratio_blocks = [("ours / vLLM (above 1: faster than vLLM)", summary["vs_peer"])]
    ratio_blocks += [(f"against {first} (above 1: faster than {first})", rows)
                     for first, rows in summary["vs_first"].items() if rows]
    for title, rows in ratio_blocks:
        if rows:
            lines.append(f"  {title}")
            lines += [line(n, ["-" if v is None else f"{v:.2f}x" for v in row.values()]) for n, row in rows.items()]
    lines.append("  where")
    lines += [f"  {c['header']:<16} {c['meaning']}" for c in summary["columns"].values()]
    return lines


def plot_summary(path: str | Path, summary: dict, title: str) -> None:
    """Grouped bars, one group per workload, each group scaled to its fastest engine (prefill's
    thousands of tokens/s would otherwise flatten the rest); the bars are labelled in tokens/s."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed: write a file
    import matplotlib.pyplot as plt
    import numpy as np

    names, columns = list(summary["rows"]), list(summary["columns"].values())
    fig, ax = plt.subplots(figsize=(2.6 * len(columns) + 2, 4.6))
    width = 0.8 / len(names)
    tops = [max((summary["rows"][n][key] or 0) for n in names) for key in summary["columns"]]
    for i, name in enumerate(names):
        values = list(summary["rows"][name].values())
        heights = [v / top if v and top else 0 for v, top in zip(values, tops)]
        bars = ax.bar(np.arange(len(columns)) + (i - (len(names) - 1) / 2) * width, heights, width, label=name)
        ax.bar_label(bars, labels=[fmt(v) for v in values], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(range(len(columns)), [f"{c['header']}\n({c['unit']})" for c in columns])
    ax.set(ylabel="share of the workload's fastest (bars: tokens/s)", ylim=(0, 1.35), title=title)
    ax.legend(fontsize=8, loc="upper left", ncols=min(len(names), 4))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str | Path, config: dict, measured: dict[str, Measured], summary: dict) -> None:
    """Every workload's statistics and requests, as the single-workload benchmark saves one, then the table."""
    data = {"config": config, "workloads": {
        key: {"modes": dict(zip(m.labels, m.modes)),
              "results": [{"stats": asdict(s), "requests": [asdict(r) for r in recs]}
                          for s, recs in zip(m.stats, m.records)]}
        for key, m in measured.items()}, "summary": summary}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))


def run_table(measure_one: Callable[[Callable], Measured], args, config: dict, peer_name: str | None) -> dict:
    """Measure the four workloads one after another; measure_one(build) measures the requests
    build(engine) gives each engine. Outputs are saved first, so the table is the last thing printed."""
    measured = {}
    for column in COLUMNS:
        measured[column.key] = m = measure_one(lambda engine, c=column: c.build(engine.tokenizer, args.seed))
        print("\n".join([workload_line(column, m, args.runs), *beyond_budget_lines(m)]), flush=True)
    summary = summarize(measured, peer_name)
    if args.json:
        write_json(args.json, config, measured, summary)
        print(f"[saved] {args.json}")
    if args.plot:
        plot_summary(args.plot, summary, f"Speed table, {runs_said(args.runs)} per workload")
        print(f"[saved] {args.plot}")
    print("\n".join(summary_lines(summary, args.runs)))
    return {"config": config, "workloads": measured, "summary": summary}
