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
        --engine minivllm:LLM --batch StaticBatchEngine

`--workload mixed` is Chapter 9's: 32 requests with the prompt lengths and budgets of
`data/mixed_workload.json`, each with its own max_new_tokens. An engine whose record says it
schedules itself (`capabilities()`, an engine loop) gets them all at once; an engine named by
`--batch` gets them in batches through its `generate_batch`, each batch run to its largest
budget (Chapter 1's BaselineEngine answers a batch one request after another, Chapter 5's
engine as one static batch); any other engine runs them one by one.
`--workload table` is Chapter 13's speed table (kit/suite.py): batch 1, a 489-token prefill,
batch 32 and the mixed workload, one after another, summed up in one table of tokens/s:

    python 06_benchmark_offline.py --workload table --ignore-eos --runs 1 \\
        --engine 04_engine:BaselineEngine --engine minivllm:LLM \\
        --engine 17_compile:CompiledEngine --batch BaselineEngine --peer vllm

The engine's feature flags (`--quant`, `--prefix-caching`, `--kv-memory`, `--max-num-seqs`, ...,
the same as 05_server.py's) become constructor keywords of every engine named: an engine
without that feature is refused in one line rather than measured without it. Flags inside an
engine's quoted spec are that engine's alone, and win over the shared ones (Chapter 12's formats
side by side):

    python 06_benchmark_offline.py --ignore-eos --engine 10_model_engine:ModelEngine \\
        --engine "16_quantization_engine:QuantizedEngine --quant int8" \\
        --engine "16_quantization_engine:QuantizedEngine --quant int4"

`--peer vllm` adds vLLM's CPU build as one more row, run in its own venv on the same model
folder and the same requests, alternating with our engines run by run (kit/peers.py;
install it once with `bash scripts/peers/install_vllm.sh /tmp/peers/vllm`):

    python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos \\
        --engine minivllm:LLM --peer vllm
"""

from __future__ import annotations

import argparse
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from kit import bench, cli, peers, progress, suite
from kit.bench import RequestRecord
from kit.engines import DEFAULT_ENGINE, load_engine
from kit.workloads import WorkItem, load_prompts, mixed_workload
from minivllm.contracts import SamplingParams
from minivllm.model_files import resolve_model
from minivllm.text import render_chat


def prompt_text(engine, prompt: dict) -> str:
    """What the engine sees: chats go through the model's own chat template."""
    return prompt["text"] if "text" in prompt else render_chat(engine.tokenizer, prompt["messages"])


def record_of(result, latency_s: float, queued_s: float = 0.0) -> RequestRecord:
    """latency_s runs from the request's submission; queued_s of it passed before the engine
    started on it. The engine times its TTFT from when it started, so the queue is added to it."""
    m = result.metrics
    ttft_ms = None if m.ttft_ms is None else m.ttft_ms + queued_s * 1000
    return RequestRecord(latency_s * 1000, m.input_tokens, m.output_tokens, ttft_ms, m.tpot_ms)


# --8<-- [start:measured-loop]
def run_sequential(engine, items: list[WorkItem], params, bar) -> tuple[list, float]:
    """Every request submitted at once, served one at a time. Returns records and total seconds.

    The clock starts when the workload is handed over, as it does for an engine that takes all
    the requests at once: request k's latency includes the k-1 requests it queued behind."""
    records, t0 = [], time.perf_counter()
    for item in items:
        started = time.perf_counter()
        result = engine.generate(item.prompt, item.max_new_tokens, params)
        records.append(record_of(result, time.perf_counter() - t0, queued_s=started - t0))
        bar.update(1)
    return records, time.perf_counter() - t0


def run_batched(engine, items: list[WorkItem], params, bar, batch_size: int | None) -> tuple[list, float]:
    """generate_batch over chunks; every request in a chunk finishes when the chunk does.

    A static batch has one budget, its largest request's. A request counts only the tokens
    its own budget allows: the rest is work it never asked for, paid for in everyone's wait.
    As in run_sequential, every request was submitted at the start: a later chunk's requests
    count the earlier chunks' time as their queue."""
    records, size, t0 = [], batch_size or len(items), time.perf_counter()
    for i in range(0, len(items), size):
        chunk = items[i: i + size]
        started = time.perf_counter()
        results = engine.generate_batch([w.prompt for w in chunk], max(w.max_new_tokens for w in chunk), params)
        done = time.perf_counter()
        for item, result in zip(chunk, results):
            record = record_of(result, done - t0, queued_s=started - t0)
            record.beyond_budget = max(0, record.output_tokens - item.max_new_tokens)
            record.output_tokens -= record.beyond_budget
            records.append(record)
        bar.update(len(chunk))
    return records, time.perf_counter() - t0
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


# When a request's clock starts, the same for every engine: the whole workload is handed over at once.
SUBMITTED = "all of a run's requests at its start, for every engine (one at a time, the rest queue)"


def runner_for(engine, spec: str, label: str, args, n: int) -> tuple[str, object]:
    """How this engine meets the workload: its engine loop if it has one (all requests at once),
    static batches where --batch names it (or names no engine), otherwise one after another."""
    if engine.capabilities().schedules_itself:
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


def measure(engines: list, runners: list, items: list[list[WorkItem]], params, args,
            labels: list[str] | None = None) -> tuple[list, list]:
    """Warm each engine up, then time args.runs passes: every engine's records and seconds."""
    labels = labels or [type(e).__name__ for e in engines]
    estimates = []
    for engine, label, engine_items, (_, run) in zip(engines, labels, items, runners):
        warm = (engine_items * args.warmup)[: args.warmup]
        if warm and run is not peers.run_peer:   # the peer warms up in its own process, every run
            progress.say(f"[warm-up] {label}: {len(warm)} request(s), not counted")
            recs, secs = run(engine, warm, params, progress.Progress(len(warm), "requests", enabled=False))
            estimates.append(progress.estimate_s(secs, sum(r.output_tokens for r in recs),
                                                 sum(w.max_new_tokens for w in engine_items) * args.runs))
    total = args.runs * sum(map(len, items))
    if estimates and None not in estimates:   # said before the long part starts, not discovered after it
        progress.say(f"[plan] {total} requests ({args.runs} run(s) x {len(engines)} engine(s)): at most about "
                     f"{progress.duration(sum(estimates))} at the warm-up's pace")
    # --8<-- [start:alternate]
    records, seconds = [[] for _ in engines], [0.0 for _ in engines]
    with progress.Progress(total, "requests", "benchmark") as bar:
        for _ in range(args.runs):
            # Alternate engines within each repetition so machine noise hits all of them alike.
            for i, (engine, (_, run)) in enumerate(zip(engines, runners)):
                bar.note = labels[i]
                recs, secs = run(engine, items[i], params, bar)
                records[i] += recs
                seconds[i] += secs
    # --8<-- [end:alternate]
    return records, seconds


def measure_workload(engines, specs, labels, peer, build, params, args, parser) -> suite.Measured:
    """One workload measured: build(engine) gives each engine its requests (the peer gets the
    first engine's); a peer that failed, now or on an earlier workload, is left out with the reason."""
    try:
        items = [build(e) for e in engines]
    except ValueError as exc:
        parser.error(str(exc))
    runners = [runner_for(e, spec, label, args, len(its)) for e, spec, label, its in zip(engines, specs, labels, items)]
    if peer and not peer.error:   # one more engine in the alternation: the same requests, the same model folder
        engines, items, labels = engines + [peer], items + [items[0]], labels + [peer.name]
        runners.append(("all at once (median of its 3 passes)", peers.run_peer))
    try:   # a request the engine refuses (a prompt plus budget past the context) ends the run in one line
        records, seconds = measure(engines, runners, items, params, args, labels)
    except ValueError as exc:
        parser.error(f"an engine refused a request of this workload: {exc}")
    if peer and labels[-1] == peer.name and peer.error:   # our rows stand; the peer's is dropped
        print(f"[peer] vLLM failed, its row is left out: {peer.error}", flush=True)
        labels, records, seconds, runners = labels[:-1], records[:-1], seconds[:-1], runners[:-1]
    stats = [bench.bench_stats(label, recs, secs) for label, recs, secs in zip(labels, records, seconds)]
    return suite.Measured(labels, stats, records, [mode for mode, _ in runners], items[0])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Offline benchmark: time engine.generate in-process.")
    bench.common_args(parser, table=True)
    parser.add_argument("--runs", type=cli.integer(1, 1000), default=2, help="measured passes over the prompt set")
    parser.add_argument("--batch", nargs="*", metavar="ENGINE", default=None,
                        help="time generate_batch (static batches) instead of generate: for every engine, "
                        "or only those named (as --engine gives them, or their Class). Engines that "
                        "schedule themselves always get every request at once")
    parser.add_argument("--batch-size", type=cli.integer(1, 4096), default=None, help="with --batch: chunks of this size")
    parser.add_argument("--device", default=None)
    peers.add_args(parser)
    args = parser.parse_args(argv)
    bench.check_common(parser, args)
    suite.check_args(parser, args)
    if args.batch_size is not None and args.batch is None:
        parser.error("--batch-size only applies with --batch")
    peers.check_args(parser, args)

    specs = args.engine or [DEFAULT_ENGINE]
    labels = bench.engine_labels(specs)
    unknown = set(args.batch or ()) - set(specs) - set(labels)
    if unknown:
        parser.error(f"--batch names engines not given with --engine: {', '.join(sorted(unknown))}")
    params = SamplingParams(ignore_eos=args.ignore_eos)   # greedy: every engine does the same work
    options = cli.engine_options(args)   # to every engine: one lacking a feature is refused, not run without it
    try:
        engines = [load_engine(spec, args.model, device=args.device, **options)
                   for spec in specs]   # each loaded once; a spec's own flags win over the shared ones
    except ValueError as exc:
        parser.error(str(exc))
    peer = None
    if args.peer:
        peer = peers.find(args.peer, args.peer_venv, resolve_model(args.model), torch.get_num_threads(),
                          args.peer_timeout, options, engines[0].tokenizer)
        print(peer.announce(), flush=True)
    first = engines[0].capabilities()
    config = {**vars(args), "engine": specs,   # what was really run, for the record
              "model": first.model_name or args.model, "device": first.device or "",
              "peer": peer.describe() if peer else None}
    measure_one = functools.partial(measure_workload, engines, specs, labels, peer, params=params, args=args,
                                    parser=parser)
    if args.workload == "table":
        return suite.run_table(measure_one, args, config, peer.name if peer else None)

    m = measure_one(functools.partial(workload, args=args))
    config["mode"] = suite.report(m, args, config, peer.name if peer else None, SUBMITTED)
    return {"config": config, "stats": m.stats, "records": m.records}


if __name__ == "__main__":
    main()
