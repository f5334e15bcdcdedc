"""13_continuous_batching_demo.py - Chapter 9's demonstration: live traffic, traced step by step.

    python 13_continuous_batching_demo.py                          # the trace, then three servers compared
    python 13_continuous_batching_demo.py --plot ch9-timeline.png  # the schedule as a timeline, vs static batching
    python 13_continuous_batching_demo.py --kv-memory 16MB --no-compare   # a pool too small: preemptions
    python 13_continuous_batching_demo.py --small                  # a quick look
    python 13_continuous_batching_demo.py --clock steps            # the same schedule on every machine

Requests of the mixed workload (kit.workloads.mixed_workload, budgets scaled by
--output-scale) arrive at Poisson times (--rate per second), and the same arrivals go to three servers:
continuous (LLM.submit() at each arrival, from a thread), static (a FIFO server
that, whenever it is free, runs everything that has arrived as one Chapter 5 batch) and sequential
(the same server, one request at a time). Times count from the first arrival.

What varies with the machine: arrivals are in seconds (--clock wall, the default), and a step's
length is not, so a slower machine sees more requests arrive while a step runs. Which step
admits whom, and so the whole trace, changes with it (where one machine admits r3 to r5 in
one step, a slower one may admit r2 to r4), and so do the three servers' ratios: on a
loaded machine the static server has come out at 0.6x the sequential one. With
--clock steps, request i instead arrives at the end of step floor(t_i / 0.25 s), as if
every step took 0.25 s (an idle engine skips to the next arrival), so every column of the
trace but the times is the same on every machine; the static and sequential servers then
replay the arrivals as they happened, in seconds. Run time, on a 2-core AMD EPYC virtual
machine with one torch thread (2026-12-04): the default run took 36 s while the machine was
quiet (37 s with --clock steps), and --small --clock steps 186 s at a load average of 15; on
another 2-core machine, loaded, the default run took 177 s.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import random
import threading
import time

from kit import bench, cli, workloads
from kit.cli import parse_bytes
from kit.workloads import WorkItem
from minivllm import LLM, model_files
from minivllm.contracts import SamplingParams

static09 = importlib.import_module("09_static_batching")


class TracedEngine(LLM):
    """The engine with a stopwatch on each step: the trace needs when a step began, not only when it ended."""

    def step(self):
        self.step_began = time.perf_counter()
        return super().step()


# --8<-- [start:tracer]
class Tracer:
    """engine.on_step: one record per step, and each request's segments for the timeline."""

    def __init__(self, engine: TracedEngine, t_start: float):
        self.engine, self.t_start, self.steps = engine, t_start, []
        self.segments: dict[int, list[list]] = {}     # request id -> [kind, t0, t1, last step]
        self.decoding: set[int] = set()                # prefill done: from now on one token a step

    def on_step(self, work, events) -> None:
        t0, t1 = self.engine.step_began - self.t_start, time.perf_counter() - self.t_start
        step, produced = len(self.steps) + 1, {r.id for r, _ in events}
        rec = {"step": step, "t0": t0, "t1": t1, "tokens": work.num_tokens, "decodes": 0, "chunks": [],
               "finished": [r.id for r, _ in events if r.finish_reason],
               "preempted": [r.id for r in work.preempted]}
        for r in work.preempted:          # its blocks are gone: it waits, then recomputes from token 0
            self.decoding.discard(r.id)
            self.segments[r.id].append(["preempted", t0, None, step])
        for r, start, n in zip(work.requests, work.starts, work.lengths):
            segs = self.segments.setdefault(r.id, [])
            if segs and segs[-1][2] is None:
                segs[-1][2] = t0          # a preempted wait ends when it is scheduled again
            if r.id not in self.decoding:     # a prefill chunk; start == 0 means admitted this step
                rec["chunks"].append((r.id, start, start + n, r.num_tokens - (r.id in produced)))
                segs.append(["prefill", t0, t1, step])
                if r.id in produced:      # the chunk that completed its known tokens also sampled one
                    self.decoding.add(r.id)
            elif segs[-1][0] == "decode" and segs[-1][3] == step - 1:
                segs[-1][2:], rec["decodes"] = [t1, step], rec["decodes"] + 1   # one bar for a run of steps
            else:
                segs.append(["decode", t0, t1, step])
                rec["decodes"] += 1
        rec.update(free=self.engine.blocks.num_free, waiting=len(self.engine.scheduler.waiting),
                   running=len(self.engine.scheduler.running))
        self.steps.append(rec)
# --8<-- [end:tracer]


STEP_S = 0.25   # --clock steps: the length of a step, as far as arrivals are concerned


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps with mean 1/rate seconds, the first at 0."""
    rng = random.Random(seed)
    return list(itertools.accumulate([0.0] + [rng.expovariate(rate) for _ in range(n - 1)]))


# --8<-- [start:replay]
def run_continuous(engine: TracedEngine, items: list[WorkItem], arrivals: list[float],
                   params: SamplingParams, step_s: float | None = None) -> dict:
    """Submit each request at its arrival time from a thread, as clients of a server would.
    With step_s (the step clock), request i is submitted at the end of step floor(arrivals[i] / step_s)
    instead, and `arrivals` becomes the times it was submitted at."""
    t_start = time.perf_counter()
    tracer, streams = Tracer(engine, t_start), [None] * len(items)
    engine.on_step = tracer.on_step
    if step_s is not None:
        arrivals = submit_by_step(engine, tracer, items, [int(at / step_s) for at in arrivals], params, streams)
    else:
        def clients() -> None:
            for i, (item, at) in enumerate(zip(items, arrivals)):
                time.sleep(max(0.0, t_start + at - time.perf_counter()))
                streams[i] = engine.submit(item.prompt, item.max_new_tokens, params)

        thread = threading.Thread(target=clients)
        thread.start()
        thread.join()
    results = [list(s)[-1] for s in streams]      # text pieces, then the GenerateResult
    engine.on_step = None
    requests = []
    for at, s, res in zip(arrivals, streams, results):
        r, segs = s.request, [seg[:3] for seg in tracer.segments[s.request_id]]
        requests.append({"arrival": at, "first": r.t_first - t_start, "last": r.t_last - t_start,
                         "ids": res.output_ids, "preemptions": r.preemptions, "queue_ms": res.metrics.queue_ms,
                         "segments": [["waiting", at, segs[0][1]]] + segs})
    labels = {s.request_id: f"r{i}" for i, s in enumerate(streams)}
    return {"name": "continuous", "requests": requests, "steps": tracer.steps, "labels": labels,
            "arrivals": arrivals}


def submit_by_step(engine: TracedEngine, tracer: Tracer, items: list[WorkItem], due: list[int],
                   params: SamplingParams, streams: list) -> list[float]:
    """The step clock: request i is handed over at the end of step due[i] (0: before the first),
    from the engine loop's own thread, so it is in the scheduler's queue when the next step is
    planned, however long the steps take. Returns when each was handed over, in seconds."""
    submitted, clock, everyone_in = [0.0] * len(items), {"step": 0, "next": 0}, threading.Event()

    def hand_over() -> None:           # all that are due in one go: they join the same step
        first = clock["next"]
        while clock["next"] < len(items) and due[clock["next"]] <= clock["step"]:
            clock["next"] += 1
        now = time.perf_counter() - tracer.t_start
        new = [engine.new_request(it.prompt, it.max_new_tokens, params) for it in items[first:clock["next"]]]
        streams[first:clock["next"]], submitted[first:clock["next"]] = engine.submit_all(new), [now] * len(new)
        if clock["next"] == len(items):
            everyone_in.set()

    def on_step(work, events) -> None:
        tracer.on_step(work, events)
        clock["step"] += 1
        if not engine.scheduler.has_work() and clock["next"] < len(items):
            clock["step"] = max(clock["step"], due[clock["next"]])   # idle: the clock skips to the next arrival
        hand_over()

    engine.on_step = on_step
    clock["step"] = due[0]
    hand_over()
    everyone_in.wait()
    return submitted


def static_batch(engine, items: list[WorkItem], params: SamplingParams) -> list:
    """Chapter 5's batch, each row with its own budget: rows stop on their own, the batch when its longest does."""
    encoded = [engine.encode(it.prompt, params.token_budget(it.max_new_tokens)) for it in items]
    requests = [engine.output.new_request(ids[0].tolist(), params, params.token_budget(it.max_new_tokens))
                for it, ids in zip(items, encoded)]
    for _ in engine.decode_loop(*engine.left_pad(encoded), requests):
        pass
    return requests


def run_fifo(engine, items: list[WorkItem], arrivals: list[float], params: SamplingParams,
             batch_size: int, name: str) -> dict:
    """A server that, whenever it is free, runs everything that has arrived (up to batch_size) to the end."""
    t_start, requests, done = time.perf_counter(), [None] * len(items), 0
    while done < len(items):
        time.sleep(max(0.0, t_start + arrivals[done] - time.perf_counter()))
        now = time.perf_counter() - t_start
        batch = [i for i in range(done, len(items)) if arrivals[i] <= now][:batch_size]
        seqs = static_batch(engine, [items[i] for i in batch], params)
        end = time.perf_counter() - t_start
        for i, s in zip(batch, seqs):
            first, last = s.t_first - t_start, s.t_last - t_start
            requests[i] = {"arrival": arrivals[i], "first": first, "last": last, "ids": s.new_ids,
                           "segments": [["waiting", arrivals[i], now], ["prefill", now, first],
                                        ["decode", first, last], ["held", last, end]]}
        done += len(batch)
    return {"name": name, "requests": requests}
# --8<-- [end:replay]


def summary(run: dict) -> dict:
    reqs = run["requests"]
    tokens = sum(len(r["ids"]) for r in reqs)
    span = max(r["last"] for r in reqs) - min(r["arrival"] for r in reqs)
    ttft = bench.summarize((r["first"] - r["arrival"]) * 1e3 for r in reqs)
    latency = bench.summarize((r["last"] - r["arrival"]) * 1e3 for r in reqs)
    return {"tokens": tokens, "span_s": span, "tokens_per_s": tokens / span, "ttft": ttft, "latency": latency}


def print_trace(run: dict, num_blocks: int) -> None:
    label = run["labels"].get
    print(f"\n[Trace] one line per step (runs of decode-only steps folded). decode: requests fed their newest "
          f"token;\n  free: free KV blocks of {num_blocks}; wait: requests waiting; -r3 finished, !r3 preempted; "
          f"r3[0:95]: a prefill\n  chunk, tokens 0-94 of r3 (+r3[0:..]: admitted this step)")
    print(f"  {'step':>7} {'t (s)':>6} {'decode':>6} {'tokens':>6} {'free':>5} {'wait':>4}  {'left':<12} prefill chunks")
    quiet = []
    for s in run["steps"] + [None]:
        if s and not (s["chunks"] or s["finished"] or s["preempted"]):
            quiet.append(s)
            continue
        if len(quiet) > 1:
            lo, hi = min(q["decodes"] for q in quiet), max(q["decodes"] for q in quiet)
            print(f"  {quiet[0]['step']:>3}-{quiet[-1]['step']:<3} {quiet[0]['t0']:>6.2f} "
                  f"{lo if lo == hi else f'{lo}-{hi}':>6}  ({len(quiet)} decode-only steps, "
                  f"{quiet[-1]['t1'] - quiet[0]['t0']:.1f} s)")
        for q in (quiet if len(quiet) == 1 else []) + ([s] if s else []):
            chunks = " ".join(f"{'+' if a == 0 else ''}{label(i)}[{a}:{b}{'' if b == n else f' of {n}'}]"
                              for i, a, b, n in q["chunks"])
            left = " ".join([f"-{label(i)}" for i in q["finished"]] + [f"!{label(i)}" for i in q["preempted"]])
            print(f"  {q['step']:>7} {q['t0']:>6.2f} {q['decodes']:>6} {q['tokens']:>6} {q['free']:>5} "
                  f"{q['waiting']:>4}  {left:<12} {chunks}".rstrip())
        quiet = []


def print_requests(items: list[WorkItem], lengths: list[int], runs: list[dict]) -> None:
    print(f"\n[Requests]  TTFT and latency in seconds from arrival, {' / '.join(r['name'] for r in runs)}")
    print(f"  {'req':<4}{'arrive':>7}{'prompt':>7}{'budget':>7}{'output':>7}  {'TTFT':<18}  {'latency':<18}"
          f"{'preempted':>9}")
    for i, item in enumerate(items):
        rows = [run["requests"][i] for run in runs]
        ttft = " / ".join(f"{r['first'] - r['arrival']:.1f}" for r in rows)
        lat = " / ".join(f"{r['last'] - r['arrival']:.1f}" for r in rows)
        print(f"  r{i:<3}{rows[0]['arrival']:>7.2f}{lengths[i]:>7}{item.max_new_tokens:>7}"
              f"{len(rows[0]['ids']):>7}  {ttft:<18}  {lat:<18}{rows[0].get('preemptions', 0):>9}")


def print_comparison(runs: list[dict]) -> None:
    stats, base = [summary(r) for r in runs], summary(runs[-1])
    print(f"\n[Same requests, same arrivals]  ratios to {runs[-1]['name']}")
    print(f"  {'server':<12}{'tokens':>7}{'span s':>8}{'tokens/s':>10}{'ratio':>7}{'TTFT mean':>11}{'TTFT p50':>10}"
          f"{'latency mean':>14}")
    for run, s in zip(runs, stats):
        print(f"  {run['name']:<12}{s['tokens']:>7}{s['span_s']:>8.1f}{s['tokens_per_s']:>10.1f}"
              f"{s['tokens_per_s'] / base['tokens_per_s']:>6.1f}x{s['ttft']['mean'] / 1e3:>10.2f}s"
              f"{s['ttft']['p50'] / 1e3:>9.2f}s{s['latency']['mean'] / 1e3:>13.2f}s")
    for run in runs[1:]:
        same = sum(a["ids"] == b["ids"] for a, b in zip(runs[0]["requests"], run["requests"]))
        print(f"  greedy outputs identical to {run['name']}: {same} of {len(run['requests'])}")


COLORS = {"waiting": "#dddddd", "prefill": "tab:orange", "decode": "tab:blue", "preempted": "#f4a6a6",
          "held": "white"}


def plot(runs: list[dict], path: str) -> None:
    """The timelines of continuous and static batching on one time axis, then the comparison (if any)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    timelines, n = [r for r in runs if r["name"] != "sequential"], len(runs[0]["requests"])
    heights = [0.8 + n / 4] * len(timelines) + ([2.6] if len(runs) > 1 else [])
    fig = plt.figure(figsize=(12, sum(heights) * 1.15))
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    xmax = max(r["last"] for run in timelines for r in run["requests"]) * 1.02
    for k, run in enumerate(timelines):
        ax = fig.add_subplot(grid[k, :])
        for row, req in enumerate(run["requests"]):
            for kind, a, b in req["segments"]:
                ax.broken_barh([(a, max(b - a, 1e-3))], (row - 0.38, 0.76), facecolors=COLORS[kind],
                               edgecolor="black" if kind in ("prefill", "held") else "none", linewidth=0.4,
                               hatch="////" if kind == "held" else None)
            ax.plot([req["arrival"]], [row], marker=">", color="black", markersize=4)
        ax.set_yticks(range(n), [f"r{i}" for i in range(n)], fontsize=7)
        ax.set(xlim=(0, xmax), ylim=(n - 0.5, -0.5), xlabel="seconds since the first arrival (▸ marks when each request arrived)",
               title=f"{run['name']} batching: one row per request")
        ax.grid(axis="x", alpha=0.3)
    names = {"waiting": "waiting", "prefill": "prefill (one bar per chunk)", "decode": "decode",
             "preempted": "preempted, waiting to recompute", "held": "done, held by its static batch"}
    drawn = {kind for run in timelines for req in run["requests"] for kind, _, _ in req["segments"]}
    fig.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="black", hatch="////" if k == "held" else None, label=v)
                        for k, v in names.items() if k in drawn], loc="upper center", ncol=5, fontsize=8, frameon=False)
    if len(runs) > 1:
        stats, colors = [summary(r) for r in runs], [f"C{j}" for j in range(len(runs))]
        left, right = fig.add_subplot(grid[-1, 0]), fig.add_subplot(grid[-1, 1])
        left.bar_label(left.bar([r["name"] for r in runs], [s["tokens_per_s"] for s in stats], color=colors),
                       fmt="%.1f")
        left.set(title="Output tokens/s (same requests, same arrivals)", ylabel="tokens/s")
        left.set_ylim(0, max(s["tokens_per_s"] for s in stats) * 1.15)
        width = 0.8 / len(runs)
        for j, (run, s) in enumerate(zip(runs, stats)):
            values = [s["ttft"]["mean"] / 1e3, s["ttft"]["p50"] / 1e3, s["latency"]["mean"] / 1e3]
            right.bar([x + j * width for x in range(3)], values, width, label=run["name"], color=colors[j])
        right.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(3)], ["TTFT mean", "TTFT p50", "latency mean"])
        right.set(title="Latency from arrival", ylabel="seconds")
        right.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))   # room for the legend on top
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\n[Plot] saved {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Chapter 9: continuous batching on a mixed workload, traced.")
    cli.add_model_flags(parser)
    parser.add_argument("--dtype", default="auto", choices=model_files.DTYPE_NAMES)
    parser.add_argument("--requests", type=cli.integer(1, 1000), default=None,
                        help="first N of the mixed workload (default 12)")
    parser.add_argument("--rate", type=cli.number(above=0), default=4.0,
                        help="mean arrivals per second (Poisson, default 4)")
    parser.add_argument("--output-scale", type=cli.number(above=0, high=16), default=None,
                        help="times each max_tokens (default 0.25)")
    parser.add_argument("--seed", type=cli.integer(0, 2**32 - 1), default=0, help="arrival times and prompt texts")
    parser.add_argument("--clock", choices=("wall", "steps"), default="wall",
                        help=f"wall (default): arrivals in seconds, so the schedule depends on the machine's speed; "
                             f"steps: request i arrives after step floor(t_i / {STEP_S} s), the same schedule anywhere")
    parser.add_argument("--kv-memory", default="512MB",
                        help="KV pool of the continuous engine (default 512MB; MB means MiB, 2**20 bytes)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences per step (and static's batch)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per step")
    parser.add_argument("--small", action="store_true", help="6 requests, budgets x0.125: a quick look")
    parser.add_argument("--no-compare", action="store_true", help="only the continuous run (no static/sequential)")
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), help="save the timelines and the comparison here")
    args = parser.parse_args(argv)
    if args.small and (args.requests, args.output_scale) != (None, None):
        parser.error("--small sets --requests 6 and --output-scale 0.125: give either --small or those")
    args.requests = args.requests or (6 if args.small else 12)
    args.output_scale = args.output_scale or (0.125 if args.small else 0.25)
    try:
        engine = TracedEngine(args.model, device=args.device, dtype=args.dtype,
                              kv_memory=parse_bytes(args.kv_memory), max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    params = SamplingParams()          # greedy, EOS on: answers end when the model says so, or at the budget
    raw = workloads.mixed_workload(engine.tokenizer, args.requests, args.seed)
    items, lengths = [], []
    fits = min(engine.blocks.num_blocks * engine.blocks.block_size, engine.context_length)
    for i, it in enumerate(raw):       # a request longer than the whole pool is refused, never queued
        budget, n = max(1, round(it.max_new_tokens * args.output_scale)), len(engine.tokenizer(it.prompt).input_ids)
        if n + budget > fits:
            print(f"[Workload] r{i} left out: {n} + {budget} tokens can never fit the pool or the context "
                  f"({fits} tokens)")
        else:
            items.append(WorkItem(it.prompt, budget))
            lengths.append(n)
    if not items:
        raise SystemExit(f"error: no request fits in {fits} tokens (the KV pool or the context): raise "
                         "--kv-memory or lower --output-scale")
    arrivals = arrival_times(len(items), args.rate, args.seed)
    budgets = [it.max_new_tokens for it in items]
    print(f"\n[Workload] {len(items)} requests of data/mixed_workload.json: prompts {min(lengths)}-{max(lengths)} "
          f"tokens, budgets {min(budgets)}-{max(budgets)} (x{args.output_scale}), Poisson arrivals at "
          f"{args.rate:g}/s over {arrivals[-1]:.1f} s" + (f", counted in steps of {STEP_S} s" if args.clock == "steps"
                                                          else "") + "; greedy")
    engine.generate("Hello", 2)        # warm-up: the first step pays for lazy initialisation
    runs = [run_continuous(engine, items, arrivals, params, STEP_S if args.clock == "steps" else None)]
    arrivals = runs[0]["arrivals"]     # the step clock's arrivals, as they happened in seconds
    print_trace(runs[0], engine.blocks.num_blocks)
    if not args.no_compare:
        static = static09.StaticBatchEngine(args.model, device=args.device, dtype=args.dtype,
                                            max_batch_size=args.max_num_seqs)
        static.generate("Hello", 2)
        runs.append(run_fifo(static, items, arrivals, params, args.max_num_seqs, "static"))
        runs.append(run_fifo(static, items, arrivals, params, 1, "sequential"))
    engine.close()                     # the engine loop's thread ends; the results are all in
    print_requests(items, lengths, runs)
    if len(runs) > 1:
        print_comparison(runs)
    if args.plot:
        plot(runs, args.plot)
    return {"items": items, "arrivals": arrivals, "runs": runs, "engine": engine}


if __name__ == "__main__":
    main()
