"""results.py - retake the book's headline numbers in one sitting, on this machine.

    python scripts/results.py             # quick: about 10 minutes on a quiet 2-core machine (make results)
    python scripts/results.py --full      # the chapters' own workloads: 1 to 2 hours (make results-full)
    python scripts/results.py --peers     # vLLM's CPU build beside ours too (installed apart: kit/peers.py)

Each entry is one run of Chapter 1's offline benchmark (06_benchmark_offline.py, which loads,
warms up and alternates the engines), repeated --runs times (3 unless told) one after another:
engine A, B, C, then A, B, C again. Every rate and every ratio is the median of the runs with
their range, each ratio taken within one run, so a change in the machine's load falls on both
sides of it. A goal counts as reached only when the whole range clears it, and as missed only
when the whole range falls short; a range that straddles it shows nothing either way.

What it writes, book/outputs/results.txt, ends with the machine, date, threads and torch of the
sitting and the load average before and after; the book's Results page includes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))
OUT = REPO_ROOT / "book" / "outputs" / "results.txt"
PEER = "peer"   # in a Ratio: the peer's row (vLLM), measured beside the engines when --peers is given
PEER_NAME = "vLLM"   # its row's name in the benchmark's output (kit/peers.py)


@dataclass(frozen=True)
class Ratio:
    """Engine `over` divided by engine `under` (indexes into the entry's engines, or PEER), in one
    run; `goal` is the chapter's, None where the chapter set none."""

    what: str
    over: int | str
    under: int | str
    goal: float | None = None
    column: str | None = None   # --workload table: which column's rate


@dataclass(frozen=True)
class Entry:
    chapter: str
    title: str
    engines: list[str]
    quick: list[str] | None        # the benchmark's flags for the quick sitting (None: full only)
    full: list[str]
    ratios: list[Ratio] = field(default_factory=list)
    peer: bool = False             # measured beside vLLM when --peers is given (the peer ratios need it)


MIXED = ["--workload", "mixed", "--ignore-eos", "--warmup", "1"]
ENTRIES = [
    Entry("Chapter 9", "continuous batching against one at a time and a static batch (mixed workload)",
          ["04_engine:BaselineEngine", "09_static_batching:StaticBatchEngine", "minivllm:LLM"],
          quick=MIXED + ["--num-prompts", "8", "--batch", "StaticBatchEngine"],
          full=MIXED + ["--num-prompts", "32", "--batch", "StaticBatchEngine"],
          ratios=[Ratio("continuous / one at a time (HF)", 2, 0, 10.0), Ratio("continuous / static batch", 2, 1, 2.0)]),
    Entry("Chapter 9", "the same, Chapter 6's model on every side",
          ["10_model_engine:ModelEngine", "11_paged_kv_engine:PagedEngine", "minivllm:LLM"],
          quick=None, full=MIXED + ["--num-prompts", "32", "--batch", "PagedEngine"],
          ratios=[Ratio("continuous / one at a time", 2, 0, 10.0), Ratio("continuous / static batch", 2, 1, 2.0)]),
    Entry("Chapter 12", "batch-1 decode with int8 and int4 weights, against Chapter 6's float32 engine",
          ["10_model_engine:ModelEngine", "16_quantization_engine:QuantizedEngine --quant int8",
           "16_quantization_engine:QuantizedEngine --quant int4"],
          quick=["--num-prompts", "2", "--max-new-tokens", "32", "--ignore-eos", "--warmup", "1"],
          full=["--num-prompts", "4", "--max-new-tokens", "128", "--ignore-eos", "--warmup", "1"],
          ratios=[Ratio("int8 / float32", 1, 0, 1.7), Ratio("int4 g32 / float32", 2, 0, 2.5)]),
    Entry("Chapter 13", "the speed table: HF one at a time, eager, compiled (and vLLM)",
          ["04_engine:BaselineEngine", "minivllm:LLM", "17_compile:CompiledEngine"],
          quick=None, full=["--workload", "table", "--ignore-eos", "--warmup", "1", "--batch", "BaselineEngine"],
          ratios=[Ratio("compiled / eager, mixed 32", 2, 1, None, "mixed_32"),
                  Ratio("compiled / vLLM, mixed 32", 2, PEER, 1.0, "mixed_32"),
                  Ratio("compiled / vLLM, batch 32", 2, PEER, 1.0, "batch_32"),
                  Ratio("eager / vLLM, mixed 32", 1, PEER, None, "mixed_32")], peer=True),
    Entry("Chapters 1 and 13", "our assembled engine beside vLLM (mixed workload)", ["minivllm:LLM"],
          quick=MIXED + ["--num-prompts", "8"], full=MIXED + ["--num-prompts", "32"],
          ratios=[Ratio("vLLM / ours", PEER, 0, None)], peer=True),
]


def rows_of(data: dict, column: str | None) -> dict[str, float]:
    """One run's rate per row (engines in order, the peer last), from the benchmark's --json:
    output tokens/s, or with --workload table one column's rate."""
    if column is None:
        return {r["stats"]["name"]: r["stats"]["output_tokens_per_s"] for r in data["results"]}
    return {name: row[column] for name, row in data["summary"]["rows"].items()}


def run_benchmark(argv: list[str], threads: int, log) -> dict:
    """One run of the offline benchmark in a process of its own (nothing of one run lingers in the
    next): its --json, read back. What it prints goes to the log."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "06_benchmark_offline.py", *argv, "--json", str(out)], cwd=REPO_ROOT,
                       env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        return json.loads(out.read_text())


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def verdict(values: list[float], goal: float | None) -> str:
    """Reached only where the whole range clears the goal; missed only where all of it falls short."""
    if goal is None:
        return "(no goal)"
    low, high = min(values), max(values)
    return "reached" if low >= goal else "not reached" if high < goal else "not shown (the range straddles it)"


def fmt_range(values: list[float], unit: str = "") -> str:
    mid, low, high = spread(values)
    digits = 2 if mid < 10 else 1
    return f"{mid:.{digits}f}{unit} [{low:.{digits}f} to {high:.{digits}f}]"


def retake(entry: Entry, flags: list[str], runs: int, peers: bool, bench: Callable[[list[str]], dict]) -> list[str]:
    """Run the entry `runs` times, one after another; return its lines of the report."""
    argv = [word for spec in entry.engines for word in ("--engine", spec)] + flags + ["--runs", "1"]
    if entry.peer and peers:
        argv += ["--peer", "vllm"]
    columns = sorted({r.column for r in entry.ratios}, key=str)
    per_run: dict[str | None, list[dict[str, float]]] = {column: [] for column in columns}
    for i in range(runs):
        print(f"  [{entry.chapter}] run {i + 1} of {runs}: {entry.title}", file=sys.stderr, flush=True)
        data = bench(argv)
        for column in columns:
            per_run[column].append(rows_of(data, column))
    lines = [f"{entry.chapter}: {entry.title}", f"  python 06_benchmark_offline.py {' '.join(quoted(argv))}"]
    for column, runs_ in per_run.items():
        for label in runs_[0]:
            name = f"{label} ({column})" if column else label
            lines.append(f"  {name:<44} {fmt_range([r[label] for r in runs_])} tokens/s")
    for ratio in entry.ratios:
        runs_ = per_run[ratio.column]
        names = list(runs_[0])
        peer = PEER_NAME if PEER_NAME in names else None
        if PEER in (ratio.over, ratio.under) and peer is None:
            lines.append(f"  {ratio.what:<44} not measured (vLLM: add --peers; see kit/peers.py)")
            continue
        over, under = (peer if i == PEER else names[i] for i in (ratio.over, ratio.under))
        values = [r[over] / r[under] for r in runs_]
        goal = f"  goal {ratio.goal:g}x: " if ratio.goal is not None else "  "
        lines.append(f"  {ratio.what:<44} {fmt_range(values, 'x')}{goal}{verdict(values, ratio.goal)}")
    return lines


def quoted(argv: list[str]) -> list[str]:
    return [f'"{w}"' if " " in w else w for w in argv]


def stamp(threads: int, load_before: float, load_after: float) -> str:
    from capture_outputs import stamp as capture_stamp   # the line every capture ends with
    line = capture_stamp(threads).rstrip().removesuffix("]").rsplit(", load average", 1)[0]
    return f"{line}; 1-minute load average {load_before:.1f} before, {load_after:.1f} after]\n"


def main(argv: list[str] | None = None, bench: Callable[[list[str]], dict] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Retake the book's headline numbers in one sitting.")
    parser.add_argument("--full", action="store_true", help="the chapters' own workloads (1 to 2 hours)")
    parser.add_argument("--peers", action="store_true", help="vLLM's CPU build beside ours (kit/peers.py)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per entry (at least 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every engine")
    parser.add_argument("--model", default=None, help="the model folder (default: the book's model)")
    parser.add_argument("--only", action="append", metavar="CHAPTER", help="entries of this chapter only ('Chapter 12')")
    parser.add_argument("--out", default=str(OUT), help="where the report goes")
    parser.add_argument("--log", default=None, help="keep the benchmark's own output here")
    parser.add_argument("--note", default=None, help="a line said under the header (what else the machine ran)")
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error("--runs: at least 3, so that a median and a range mean something")
    log = open(args.log or os.devnull, "w")
    if bench is None:
        bench = lambda flags: run_benchmark(flags, args.threads, log)   # noqa: E731
    common = ["--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
    peer_only = [e for e in ENTRIES if all(PEER in (r.over, r.under) for r in e.ratios)]
    entries = [e for e in ENTRIES if (args.full or e.quick is not None) and (args.peers or e not in peer_only)
               and (not args.only or e.chapter in args.only)]
    command = " ".join(["python scripts/results.py", *(["--full"] if args.full else []), *(["--peers"] if args.peers else []),
                        *(f'--only "{c}"' for c in args.only or [])])
    report = [f"$ {command}", f"[{'full' if args.full else 'quick'} sitting: {args.runs} alternating runs per entry, "
              f"median [lowest to highest]; {args.threads} torch thread(s) for every engine]",
              *([f"[{args.note}]"] if args.note else []), ""]
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    with log:
        for entry in entries:
            try:
                report += retake(entry, common + (entry.full if args.full else entry.quick), args.runs, args.peers,
                                 bench) + [""]
            except subprocess.CalledProcessError as exc:   # one entry's failure leaves the others standing
                report += [f"{entry.chapter}: {entry.title}", f"  failed (exit {exc.returncode}); "
                           "run again with --log FILE to see why", ""]
    report.append(f"[{len(entries)} entries in {(time.perf_counter() - t0) / 60:.1f} min]")
    text = "\n".join(report) + "\n" + stamp(args.threads, load_before, os.getloadavg()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
