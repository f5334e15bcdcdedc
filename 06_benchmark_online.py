"""06_benchmark_online.py - measure an engine the way its users meet it: over HTTP, streaming.

The offline benchmark times `engine.generate` in-process. Users instead send HTTP
requests, often several at once, and watch tokens stream in. This script starts
`05_server.py` on a free loopback port, waits for `/health`, and sends the same
prompt set as the offline benchmark (text prompts to `/v1/completions`, chats to
`/v1/chat/completions`). From the client side it times every streamed token:
time to first token (TTFT), the gaps between tokens (ITL), and the whole request.

    python 06_benchmark_online.py                         # sequential, one request at a time
    python 06_benchmark_online.py --concurrency 4         # four clients in parallel
    python 06_benchmark_online.py --request-rate 0.5      # Poisson arrivals, 0.5 requests/s on average
    python 06_benchmark_online.py --url http://127.0.0.1:8000   # any running OpenAI-compatible server, e.g. vLLM

Load patterns: with neither flag, requests go one after another. `--concurrency C`
keeps at most C in flight. `--request-rate R` releases them at random, seeded
times (a Poisson process, R per second on average), like independent users would.

    python 06_benchmark_online.py --workload mixed --concurrency 32 --runs 1 --ignore-eos \\
        --engine 04_engine:BaselineEngine --engine minivllm:LLM

`--workload mixed` sends Chapter 9's mixed lengths (plain-text completions, each with its
own max_tokens). Besides throughput, goodput: the share and the rate of requests that met
a service-level objective, first token within `--slo-ttft-ms` (default 1000) and, if
given, later tokens `--slo-tpot-ms` apart. Several servers run side by side, measured in turn.

The engine's feature flags (`--quant`, `--prefix-caching`, `--kv-memory`, `--max-num-seqs`, ...)
are passed on to every server launched, as 05_server.py's own flags of the same names; flags
inside an engine's quoted spec go to its server alone (`--engine "minivllm:LLM --quant int4"`).

    python 06_benchmark_online.py --workload mixed --concurrency 32 --runs 1 --ignore-eos \\
        --engine minivllm:LLM --kv-memory 64MB --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import numpy as np
from kit import bench, cli, launcher, progress   # flags and statistics shared with the offline benchmark
from kit.bench import RequestRecord
from kit.engines import DEFAULT_ENGINE
from kit.workloads import load_prompts, mixed_workload
from minivllm.model_files import DEFAULT_MODEL, resolve_model


@contextlib.contextmanager
def launched_server(spec: str, model: str | None, device: str | None, timeout_s: float,
                    engine_options: dict | None = None) -> Iterator[str]:
    """Run 05_server.py with this engine until the block ends, however it ends (Ctrl-C included).
    engine_options (kit.cli.engine_options) become the server's own flags of the same names."""
    print(f"[server] starting {spec} ...", flush=True)
    with launcher.serve_in_subprocess(model, spec, device, startup_timeout_s=timeout_s,
                                      engine_options=engine_options) as url:
        print(f"[server] ready on {url}", flush=True)
        yield url


def request_for(prompt: dict, model_id: str, max_tokens: int, ignore_eos: bool, stream: bool) -> tuple[str, dict]:
    """The endpoint and JSON body for one benchmark prompt: chats to chat, text to completions."""
    body = {"model": model_id, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}   # exact token counts in a final chunk
    if ignore_eos:
        body["ignore_eos"] = True                           # vLLM's extension; 05_server has it too
    if "messages" in prompt:
        return "/v1/chat/completions", {**body, "messages": prompt["messages"]}
    return "/v1/completions", {**body, "prompt": prompt["text"]}


# --8<-- [start:client-timing]
async def send(client: httpx.AsyncClient, path: str, body: dict, submitted: float | None = None) -> RequestRecord:
    """One request, timed from the client: TTFT, the gap before every later token, the total.

    The clock starts at `submitted` (a perf_counter time) when the request arrived before it could
    be sent, else now: latency and TTFT then include its wait for a free connection."""
    t0 = time.perf_counter() if submitted is None else submitted
    stamps, usage = [], None   # arrival time of each text chunk; the server's token counts
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue                  # blank separators between events
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:          # a failure after the 200 arrives in the stream
                        raise ValueError(event["error"].get("message", event["error"]))
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        if choice.get("text") or (choice.get("delta") or {}).get("content"):
                            stamps.append(time.perf_counter())
        else:
            resp = await client.post(path, json=body)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            usage = resp.json().get("usage")
    except (httpx.HTTPError, ValueError) as exc:   # JSONDecodeError is a ValueError
        return RequestRecord((time.perf_counter() - t0) * 1000, error=f"{type(exc).__name__}: {exc}")
    latency_ms = (time.perf_counter() - t0) * 1000
    # Without usage, count chunks: one chunk is about one token for 05_server.
    output_tokens = usage["completion_tokens"] if usage else len(stamps)
    ttft_ms = (stamps[0] - t0) * 1000 if stamps else None
    return RequestRecord(
        latency_ms, input_tokens=(usage or {}).get("prompt_tokens", 0), output_tokens=output_tokens,
        ttft_ms=ttft_ms,
        tpot_ms=(latency_ms - ttft_ms) / (output_tokens - 1) if ttft_ms is not None and output_tokens > 1 else None,
        itl_ms=[(b - a) * 1000 for a, b in zip(stamps, stamps[1:])])
# --8<-- [end:client-timing]


# --8<-- [start:poisson]
def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start.

    Independent users make a Poisson process: the gaps between arrivals are exponential
    with mean 1/rate. Seeded, so every engine faces the very same schedule. No rate: all at once.
    """
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return [0.0] + np.cumsum(gaps[:-1]).tolist()   # the first request goes at once
# --8<-- [end:poisson]


# --8<-- [start:goodput]
def goodput(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float,
            slo_tpot_ms: float | None = None) -> dict:
    """The requests that met the service-level objective: how many, their share, their rate.

    Throughput counts every token, however late. Goodput counts only the requests a user
    would call fast enough: first token within slo_ttft_ms and, when given, the later ones
    at slo_tpot_ms apart or better on average. A failed request, or one whose TTFT was not
    measured (no streaming), misses it; a one-token answer has no TPOT to miss."""
    if duration_s <= 0 or slo_ttft_ms <= 0 or (slo_tpot_ms is not None and slo_tpot_ms <= 0):
        raise ValueError("duration and SLO limits must be > 0")

    def met(r: RequestRecord) -> bool:
        return (r.error is None and r.ttft_ms is not None and r.ttft_ms <= slo_ttft_ms
                and (slo_tpot_ms is None or r.tpot_ms is None or r.tpot_ms <= slo_tpot_ms))

    good = sum(map(met, records))
    return {"met": good, "sent": len(records), "share": good / len(records) if records else 0.0,
            "per_s": good / duration_s}
# --8<-- [end:goodput]


def print_goodput(names: list[str], results: list[dict], slo: str) -> None:
    """The goodput lines under the table, side by side, with the ratio to the first server."""
    print(f"\n[Goodput: {slo}]")
    rows = {"met SLO": [f"{g['met']} of {g['sent']}" for g in results],
            "share": [f"{g['share']:.0%}" for g in results],
            "good requests/s": [f"{g['per_s']:.3f}" for g in results]}   # rates far below 1 keep digits
    for col, g in enumerate(results[1:], start=1):
        if results[0]["per_s"]:
            rows["good requests/s"][col] += f" ({g['per_s'] / results[0]['per_s']:.2f}x)"
    if len(names) > 1:
        print(f"  {'':<18} " + "".join(f"{n:<22}" for n in names).rstrip())
    for label, cells in rows.items():
        print(f"  {label:<18} " + "".join(f"{c:<22}" for c in cells).rstrip())


async def run_load(client, jobs: list[tuple[str, dict]], concurrency: int | None, arrivals: list[float],
                   bar, rate_given: bool = False) -> tuple[list, float]:
    """Send every job at its arrival time, at most `concurrency` in flight. Returns records, seconds.
    rate_given: the arrivals are a request rate's (each request's clock starts at its arrival)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(at: float, job) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        # With a request rate, a request exists from its arrival: a wait for a free slot is queueing
        # and its clock runs. Without one, --concurrency C is C users who each send their next
        # request when the last one is answered: it is submitted when it is sent.
        async with limit:
            record = await send(client, *job, submitted=start + at if rate_given else None)
        bar.update(1)
        return record

    records = await asyncio.gather(*(one(at, job) for at, job in zip(arrivals, jobs)))
    return list(records), time.perf_counter() - start


# When a request's clock starts, the same for every server: queueing inside the server (behind
# a lock, or for a place in the batch) always counts.
SUBMITTED = ("when the client sends it (--concurrency C: C users, each sending the next when answered); "
             "with --request-rate, at its arrival, so a wait for a free slot counts")


def workload(args) -> list[tuple[dict, int]]:
    """(prompt, max_tokens) pairs: the committed prompts with one budget, or the mixed workload
    as plain-text completions, each with its own budget (tokenized with --model's tokenizer)."""
    if args.workload == "prompts":
        return [(p, args.max_new_tokens) for p in load_prompts(args.prompts, args.num_prompts)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    return [({"text": w.prompt}, w.max_new_tokens)
            for w in mixed_workload(tokenizer, args.num_prompts or 32, args.seed)]


async def model_id(client: httpx.AsyncClient, args) -> str:
    try:  # vLLM and ours check the model name
        return (await client.get("/v1/models")).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return args.model or DEFAULT_MODEL


async def measure(url: str, args, requests: list[tuple[dict, int]], warmup: int, bar) -> tuple[list, float]:
    """Warm up, then send one pass of the workload to one server."""
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout,
                                 limits=httpx.Limits(max_connections=None)) as client:
        name = await model_id(client, args)
        jobs = [request_for(p, name, budget, args.ignore_eos, not args.no_stream) for p, budget in requests]
        for job in (jobs * warmup)[:warmup]:
            await send(client, *job)
        concurrency = args.concurrency or (None if args.request_rate else 1)
        return await run_load(client, jobs, concurrency, arrival_times(len(jobs), args.request_rate, args.seed), bar,
                              rate_given=args.request_rate is not None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Online benchmark: an OpenAI-compatible server over HTTP.")
    bench.common_args(parser)
    parser.add_argument("--url", action="append", help="measure this running server instead of launching "
                        "05_server.py (repeat it to compare servers)")
    parser.add_argument("--runs", type=cli.integer(1, 1000), default=2, help="passes over the prompt set (as offline)")
    parser.add_argument("--concurrency", type=cli.integer(1, 10_000), default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--request-rate", type=cli.number(above=0), default=None,
                        help="Poisson arrivals, requests/s (seeded by --seed)")
    parser.add_argument("--slo-ttft-ms", type=cli.number(above=0), default=1000.0,
                        help="goodput: first token within this")
    parser.add_argument("--slo-tpot-ms", type=cli.number(above=0), default=None,
                        help="goodput: and this per later token")
    parser.add_argument("--no-stream", action="store_true", help="plain JSON replies (no TTFT/ITL then)")
    parser.add_argument("--timeout", type=cli.number(above=0), default=600.0,
                        help="seconds per request before it fails")
    parser.add_argument("--startup-timeout", type=cli.number(above=0), default=300.0,
                        help="seconds to wait for /health")
    parser.add_argument("--device", default=None, help="passed on to 05_server.py")
    args = parser.parse_args(argv)
    bench.check_common(parser, args)
    if args.url and args.engine:
        parser.error("give --url (servers already running) or --engine (servers to launch), not both")
    options = cli.engine_options(args)
    if args.url and options:   # a running server keeps the features it was started with
        parser.error("engine flags (--quant, --kv-memory, ...) configure the servers launched here: "
                     "drop them with --url")

    specs = args.engine or [DEFAULT_ENGINE]
    targets = args.url or specs
    labels = args.url or bench.engine_labels(specs)
    try:
        requests = workload(args)
    except ValueError as exc:
        parser.error(str(exc))
    all_records, seconds = [[] for _ in targets], [0.0 for _ in targets]
    with contextlib.ExitStack() as servers, progress.Progress(len(targets) * len(requests) * args.runs,
                                                              "requests", "benchmark") as bar:
        try:   # every server up at once (idle ones cost memory, not time), so runs can alternate
            urls = [servers.enter_context(contextlib.nullcontext(t) if args.url else
                                          launched_server(t, args.model, args.device, args.startup_timeout, options))
                    for t in targets]
            for run in range(args.runs):
                for i, url in enumerate(urls):   # one server at a time, alternating, as offline
                    bar.note = labels[i]
                    records, secs = asyncio.run(measure(url, args, requests, args.warmup if run == 0 else 0, bar))
                    all_records[i] += records
                    seconds[i] += secs
        except KeyboardInterrupt:   # Ctrl-C: the ExitStack has already stopped the servers
            print("\n[interrupted]", file=sys.stderr)
            raise SystemExit(130) from None
        except RuntimeError as exc:   # a server that did not come up: its own last lines say why
            raise SystemExit(f"error: {exc}") from None
    all_stats = [bench.bench_stats(label, recs, secs) for label, recs, secs in zip(labels, all_records, seconds)]

    mode = ("sequential" if not (args.concurrency or args.request_rate) else
            ", ".join(filter(None, [args.concurrency and f"concurrency {args.concurrency}",
                                    args.request_rate and f"Poisson {args.request_rate:g} req/s"])))
    budgets = sorted({budget for _, budget in requests})
    budget = f"max_tokens={budgets[0]}" if len(budgets) == 1 else f"own max_tokens {', '.join(map(str, budgets))}"
    title = (f"Online benchmark: {len(requests)} {'mixed requests' if args.workload == 'mixed' else 'prompts'}"
             f" x {args.runs} runs, {mode}, {'plain' if args.no_stream else 'streamed'}, {budget}"
             f"{', ignore_eos' if args.ignore_eos else ''}")
    bench.print_table(title, all_stats, SUBMITTED)
    for stats, records in zip(all_stats, all_records):
        if stats.failed:
            first_error = next(r.error for r in records if r.error)
            print(f"  [{stats.name}] {stats.failed} failed, e.g. {first_error}")
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms" + (f", TPOT <= {args.slo_tpot_ms:g} ms" if args.slo_tpot_ms else "")
    goods = [goodput(recs, secs, args.slo_ttft_ms, args.slo_tpot_ms) for recs, secs in zip(all_records, seconds)]
    if not args.no_stream:   # without streaming there is no TTFT to hold to an SLO
        print_goodput(labels, goods, slo)
    config = {**vars(args), "engine": None if args.url else specs, "targets": targets, "mode": mode,
              "slo": slo, "goodput": dict(zip(labels, goods))}
    bench.save_outputs(args, config, all_stats, all_records, title)
    return {"config": config, "stats": all_stats, "records": all_records, "goodput": goods}


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` unwinds like Ctrl-C: the server stops too
    main()
