"""06_benchmark_offline.py - measure an engine in-process: the numbers every later chapter must beat.

A benchmark is a fixed workload, a fixed way of measuring it, and distributions
rather than single averages. The workload is the committed prompt set in
`data/benchmark_prompts.json` (16 prompts, 5 to ~400 tokens, plain text and chat).
We warm up first (the first calls pay for lazy initialisation), then time every
request, and summarise latency as mean and p50/p90/p99: the slow tail is what users remember.

    python 06_benchmark_offline.py                          # the baseline, ~1-2 min on a laptop CPU
    python 06_benchmark_offline.py --ignore-eos --max-new-tokens 64
    python 06_benchmark_offline.py --batch --batch-size 8   # time generate_batch instead
    python 06_benchmark_offline.py --engine 04_engine:BaselineEngine \\
        --engine 07_decode_loop:DecodeLoopEngine --json results/offline.json --plot results/offline.png
    python 06_benchmark_offline.py --workload mixed --ignore-eos --runs 1 \\
        --engine 04_engine:BaselineEngine --engine 09_static_batching:StaticBatchEngine \\
        --engine 13_continuous_batching:ContinuousBatchingEngine --batch StaticBatchEngine

`--workload mixed` is Chapter 9's: 32 requests with the prompt lengths and budgets of
`data/mixed_workload.json`, each with its own max_new_tokens. An engine with an engine
loop (`submit`) gets them all at once; an engine named by `--batch` runs static batches
that last as long as their largest budget; any other engine runs them one by one.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

setup = importlib.import_module("01_setup")
engine_mod = importlib.import_module("04_engine")
SamplingParams = importlib.import_module("03_contracts").SamplingParams
paged_demo = importlib.import_module("11_paged_kv_demo")   # owns data/mixed_workload.json
from kit import cli
PROMPTS_PATH = setup.REPO_ROOT / "data" / "benchmark_prompts.json"


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


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The benchmark workload: dicts with either 'text' (sent as is) or 'messages' (a chat)."""
    path = Path(path or PROMPTS_PATH)
    try:
        prompts = json.loads(path.read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:   # missing, a folder, not JSON, no "prompts"
        raise ValueError(f"cannot read benchmark prompts from {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, dict) for p in prompts):
        raise ValueError(f"{path} must hold a non-empty list of prompts under the key 'prompts'")
    if any(("text" in p) == ("messages" in p) for p in prompts):
        raise ValueError("each benchmark prompt needs exactly one of 'text' or 'messages'")
    return prompts[:limit] if limit else prompts


def prompt_text(engine, prompt: dict) -> str:
    """What the engine sees: chats go through the model's own chat template."""
    return prompt["text"] if "text" in prompt else engine_mod.render_chat(engine.tokenizer, prompt["messages"])


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: the text the engine receives and its own token budget."""

    prompt: str
    max_new_tokens: int


# --8<-- [start:mixed-workload]
def mixed_workload(tokenizer, n: int = 32, seed: int = 0) -> list[WorkItem]:
    """The first n requests of data/mixed_workload.json as real text with the committed lengths.

    Request i keeps the distribution's prompt_tokens and max_tokens (cycling after 64).
    Its prompt is ordinary text: the benchmark prompts (data/benchmark_prompts.json) run
    together from a seeded starting document and cut to exactly prompt_tokens tokens.
    Prompts are plain text, sent as they are (a completion, no chat template), so the
    count is the one the engine sees: `len(tokenizer(prompt).input_ids)`. A chat template
    would add its own system prompt and make the distribution's short prompts impossible.
    Same tokenizer, n and seed: the same list; another seed changes the text, never the lengths.
    """
    if n < 1:
        raise ValueError(f"a workload needs n >= 1 requests, got {n}")
    spec = paged_demo.load_workload()["requests"]
    # Single newlines only: a cut inside a blank line would re-encode as one "\n\n" token.
    docs = [re.sub(r"\n\s*\n", "\n", p.get("text") or "\n".join(m["content"] for m in p["messages"])).strip()
            for p in load_prompts()]
    rng = random.Random(seed)
    items = []
    for i in range(n):
        req, first = spec[i % len(spec)], rng.randrange(len(docs))
        text = "\n".join(docs[first:] + docs[:first])   # starts at a document's start, wraps round
        items.append(WorkItem(text_of_length(tokenizer, text, req["prompt_tokens"]), req["max_tokens"]))
    return items


def text_of_length(tokenizer, text: str, n_tokens: int) -> str:
    """A prefix of text that tokenizes to exactly n_tokens tokens.

    Decoding the first n ids and re-encoding gives n ids back for this corpus and tokenizer
    (checked for every start and length); where another tokenizer merges differently at
    the cut, a cut up to three tokens away is tried before giving up."""
    ids = tokenizer(text).input_ids
    if n_tokens < 1 or n_tokens > len(ids):
        raise ValueError(f"cannot cut {n_tokens} tokens from a text of {len(ids)}")
    cuts = range(max(1, n_tokens - 3), min(len(ids), n_tokens + 3) + 1)
    for cut in sorted(cuts, key=lambda c: abs(c - n_tokens)):
        prefix = tokenizer.decode(ids[:cut])
        if len(tokenizer(prefix).input_ids) == n_tokens:
            return prefix
    raise ValueError(f"no prefix of the text tokenizes to exactly {n_tokens} tokens")
# --8<-- [end:mixed-workload]


def record_of(result, latency_s: float) -> RequestRecord:
    m = result.metrics
    return RequestRecord(latency_s * 1000, m.input_tokens, m.output_tokens, m.ttft_ms, m.tpot_ms)


# --8<-- [start:measured-loop]
def run_sequential(engine, items: list[WorkItem], params, bar) -> tuple[list, float]:
    """One request at a time, as a single user would send them. Returns records and total seconds."""
    records, total_s = [], 0.0
    for item in items:
        t0 = time.perf_counter()
        result = engine.generate(item.prompt, item.max_new_tokens, params)
        elapsed = time.perf_counter() - t0
        records.append(record_of(result, elapsed))
        total_s += elapsed
        bar.update(1)
    return records, total_s


def run_batched(engine, items: list[WorkItem], params, bar, batch_size: int | None) -> tuple[list, float]:
    """generate_batch over chunks; every request in a chunk finishes when the chunk does.

    A static batch has one budget, its largest request's. A request counts only the tokens
    its own budget allows: the rest is work it never asked for, paid for in everyone's wait."""
    records, total_s, size = [], 0.0, batch_size or len(items)
    for i in range(0, len(items), size):
        chunk = items[i: i + size]
        t0 = time.perf_counter()
        results = engine.generate_batch([w.prompt for w in chunk], max(w.max_new_tokens for w in chunk), params)
        elapsed = time.perf_counter() - t0
        for item, result in zip(chunk, results):
            record = record_of(result, elapsed)
            record.beyond_budget = max(0, record.output_tokens - item.max_new_tokens)
            record.output_tokens -= record.beyond_budget
            records.append(record)
        total_s += elapsed
        bar.update(len(chunk))
    return records, total_s
# --8<-- [end:measured-loop]


# --8<-- [start:all-at-once]
def run_submitted(engine, items: list[WorkItem], params, bar) -> tuple[list, float]:
    """Every request handed to the engine loop at once (`engine.submit`), each with its own budget.

    One reader thread per request notes when its result arrives: a request that leaves the
    batch early is done early. The run lasts until the last one is done."""
    t0 = time.perf_counter()
    streams = [engine.submit(w.prompt, w.max_new_tokens, params) for w in items]

    def read(stream) -> RequestRecord:
        *_, result = stream                  # text pieces, then the GenerateResult
        record = record_of(result, time.perf_counter() - t0)
        bar.update(1)
        return record

    with ThreadPoolExecutor(max_workers=len(streams)) as pool:
        records = list(pool.map(read, streams))
    return records, max(r.latency_ms for r in records) / 1000
# --8<-- [end:all-at-once]


def runner_for(engine, spec: str, label: str, args, n: int) -> tuple[str, object]:
    """How this engine meets the workload: its engine loop if it has one (all requests at once),
    static batches where --batch names it (or names no engine), otherwise one after another."""
    if hasattr(engine, "submit"):
        return "all at once", run_submitted
    if args.batch is not None and (not args.batch or spec in args.batch or label in args.batch):
        return f"batch of {min(args.batch_size or n, n)}", functools.partial(run_batched, batch_size=args.batch_size)
    return "sequential", run_sequential


def workload(engine, args) -> list[WorkItem]:
    """The requests one engine receives: the committed prompts with one budget, or the mixed workload."""
    if args.workload == "mixed":
        return mixed_workload(engine.tokenizer, args.num_prompts or 32, args.seed)
    return [WorkItem(prompt_text(engine, p), args.max_new_tokens)
            for p in load_prompts(args.prompts, args.num_prompts)]


def engine_labels(specs: list[str]) -> list[str]:
    """Short column names ('BaselineEngine'); a repeated engine becomes 'BaselineEngine#2'."""
    labels, seen = [], {}
    for spec in specs:
        base = spec.rpartition(":")[2] or spec
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


def print_table(title: str, all_stats: list[BenchStats]) -> None:
    """Aligned 'name  value' lines; with several engines, side by side with the ratio to the first."""
    print(f"\n[{title}]")
    columns = [stat_rows(s) for s in all_stats]
    if len(all_stats) > 1:
        print(f"  {'':<18} " + "".join(f"{s.name:<22}" for s in all_stats).rstrip())
    for name in columns[0]:
        if all(col[name] is None for col in columns):
            continue  # e.g. TTFT for an engine that cannot see its own loop
        cells = []
        for col in columns:
            value, first = col[name], columns[0][name]
            cell = fmt(value)
            if col is not columns[0] and value is not None and first and name not in ("requests", "failed"):
                cell += f" ({value / first:.2f}x)"
            cells.append(f"{cell:<22}")
        print(f"  {name:<18} " + "".join(cells).rstrip())
    if len(all_stats) > 1:
        print(f"  (Nx) = ratio to {all_stats[0].name}: above 1 is better for /s lines, below 1 for *_ms lines")


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


def common_args(parser: argparse.ArgumentParser) -> None:
    """The flags both benchmarks share, so the two are run the same way."""
    parser.add_argument("--engine", action="append", help="module:Class; repeat it to compare engines "
                        "(default: 04_engine:BaselineEngine)")
    parser.add_argument("--model", default=None, help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workload", choices=("prompts", "mixed"), default="prompts",
                        help="prompts: the committed prompt set, one budget (--max-new-tokens); mixed: "
                        "data/mixed_workload.json's prompt lengths and per-request budgets")
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
    """--json and --plot, for this benchmark and the online one alike."""
    if args.json:
        write_json(args.json, config, all_stats, all_records)
        print(f"\n[saved] {args.json}")
    if args.plot:
        plot_results(args.plot, all_stats, all_records, title)
        print(f"[saved] {args.plot}")


def measure(engines: list, runners: list, items: list[list[WorkItem]], params, args) -> tuple[list, list]:
    """Warm each engine up, then time args.runs passes: every engine's records and seconds."""
    for engine, engine_items, (_, run) in zip(engines, items, runners):
        warm = (engine_items * args.warmup)[: args.warmup]
        if warm:
            run(engine, warm, params, tqdm(disable=True))
    # --8<-- [start:alternate]
    records, seconds = [[] for _ in engines], [0.0 for _ in engines]
    with tqdm(total=args.runs * sum(map(len, items)), desc="requests", file=sys.stderr, disable=None) as bar:
        for _ in range(args.runs):
            # Alternate engines within each repetition so machine noise hits all of them alike.
            for i, (engine, (_, run)) in enumerate(zip(engines, runners)):
                recs, secs = run(engine, items[i], params, bar)
                records[i] += recs
                seconds[i] += secs
    # --8<-- [end:alternate]
    return records, seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Offline benchmark: time engine.generate in-process.")
    common_args(parser)
    parser.add_argument("--runs", type=cli.integer(1, 1000), default=2, help="measured passes over the prompt set")
    parser.add_argument("--batch", nargs="*", metavar="ENGINE", default=None,
                        help="time generate_batch (static batches) instead of generate: for every engine, "
                        "or only those named (module:Class or Class). Engines with submit() always get "
                        "every request at once")
    parser.add_argument("--batch-size", type=cli.integer(1, 4096), default=None, help="with --batch: chunks of this size")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    check_common(parser, args)
    if args.batch_size is not None and args.batch is None:
        parser.error("--batch-size only applies with --batch")

    specs = args.engine or ["04_engine:BaselineEngine"]
    labels = engine_labels(specs)
    unknown = set(args.batch or ()) - set(specs) - set(labels)
    if unknown:
        parser.error(f"--batch names engines not given with --engine: {', '.join(sorted(unknown))}")
    params = SamplingParams(ignore_eos=args.ignore_eos)   # greedy: every engine does the same work
    try:
        engines = [engine_mod.load_engine(spec, args.model, args.device) for spec in specs]  # each loaded once
        items = [workload(e, args) for e in engines]
    except ValueError as exc:
        parser.error(str(exc))
    runners = [runner_for(e, spec, label, args, len(its)) for e, spec, label, its in zip(engines, specs, labels, items)]
    try:   # a request the engine refuses (a prompt plus budget past the context) ends the run in one line
        records, seconds = measure(engines, runners, items, params, args)
    except ValueError as exc:
        parser.error(f"an engine refused a request of this workload: {exc}")


    all_stats = [bench_stats(label, recs, secs) for label, recs, secs in zip(labels, records, seconds)]
    modes = [mode for mode, _ in runners]
    mode = modes[0] if len(set(modes)) == 1 else ", ".join(f"{lb} {m}" for lb, m in zip(labels, modes))
    budgets = sorted({w.max_new_tokens for w in items[0]})
    budget = (f"max_new_tokens={budgets[0]}" if len(budgets) == 1 else
              f"own budgets {', '.join(map(str, budgets))}")
    title = (f"Offline benchmark: {len(items[0])} {'mixed requests' if args.workload == 'mixed' else 'prompts'}"
             f" x {args.runs} runs, {mode}, {budget}{', ignore_eos' if args.ignore_eos else ''}")
    print_table(title, all_stats)
    for stats, recs in zip(all_stats, records):
        beyond = sum(r.beyond_budget for r in recs)
        if beyond:
            print(f"  [{stats.name}] static batches run to their largest budget: {beyond} tokens generated "
                  f"past their own request's budget were not counted, but every request waited for them")
    config = {**vars(args), "engine": specs, "mode": mode,   # what was really run, for the record
              "model": getattr(engines[0], "model_name", args.model),
              "device": str(getattr(engines[0], "device", ""))}
    save_outputs(args, config, all_stats, records, title)
    return {"config": config, "stats": all_stats, "records": records}


if __name__ == "__main__":
    main()
