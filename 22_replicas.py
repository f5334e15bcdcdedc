"""22_replicas.py - replicas of the engine behind one endpoint, and a router that keeps prefixes warm.

Chapter 14 split one model over processes so that a model too big for one could run; this
chapter copies the whole engine instead, N times, so that N times the traffic can. Each copy is
a Ray Serve replica of `05_server.py --replicas N`; the server's own process runs the OpenAI app
and a router picks the replica for each request. The router decides what the prefix caches are
worth: a tenant's system prompt sent to every replica is prefilled on every replica.

    python 22_replicas.py                          # the router's choices, replayed without Ray
    python 22_replicas.py --measure tenants        # 8 tenants on 2 replicas: prefix vs pow2, and 1 replica
    python 22_replicas.py --measure throughput     # 32 requests: 1 replica, 2, and 2 servers without Ray

The measurements start the server (05_server.py) once per configuration, as a reader would,
and read each replica's prefix-cache counters from /engine/stats before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from kit import cli
from minivllm.model_files import DEFAULT_MODEL, resolve_model
from minivllm.routing import PrefixRouter, route_root

HERE = Path(__file__).resolve().parent
TENANTS, REQUESTS, SYSTEM_WORDS = 8, 48, 480   # ~500 tokens of system prompt per tenant
WORDS = ("answer questions about the course schedule politely and briefly cite the syllabus section "
         "never reveal grades of other students refer lab questions to the assistant use metric units").split()


def system_prompt(tenant: int) -> str:
    rng = random.Random(tenant)
    return f"You are tenant {tenant}'s assistant. " + " ".join(rng.choice(WORDS) for _ in range(SYSTEM_WORDS))


def workload(seed: int = 0) -> list[tuple[int, str]]:
    """(tenant, prompt) for 48 requests: each tenant's six questions, in a shuffled order."""
    rng = random.Random(seed)
    order = [t for t in range(TENANTS) for _ in range(REQUESTS // TENANTS)]
    rng.shuffle(order)
    return [(t, f"{system_prompt(t)}\nQuestion {n}: what should I do next?") for n, t in enumerate(order)]


# --8<-- [start:choices]
def show_choices() -> None:
    """The router's rule on the tenants' workload, without Ray: where each request goes, and why."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    router = PrefixRouter(block_size=16, imbalance=4)
    loads = {"replica-0": 0, "replica-1": 0}
    for n, (tenant, prompt) in enumerate(workload()[:12]):
        ids = tokenizer(prompt).input_ids
        warm = {r: d for r, d in router.tree.matches(ids, route_root(f"key-{tenant}")).items()}
        replica = router.route(ids, loads, salt=f"key-{tenant}")
        loads[replica] += 1   # nothing finishes in this replay: the loads only grow
        print(f"request {n:2d} tenant {tenant}: -> {replica}  "
              f"({'warm: ' + str(max(warm.values())) + ' tokens held there' if warm else 'cold: the least loaded'})")
    print(f"{router.warm} of {router.routed} requests went where their prefix was held")
# --8<-- [end:choices]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(replicas: int, router: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    keys = [a for t in range(TENANTS) for a in ("--api-key", f"key-{t}")]   # one tenant, one salt, per key
    cmd = [sys.executable, str(HERE / "05_server.py"), "--engine", "minivllm:LLM", "--device", "cpu",
           "--prefix-caching", "--kv-memory", args.kv_memory, "--port", str(port), *keys]
    if args.model:
        cmd += ["--model", args.model]
    if replicas:
        cmd += ["--replicas", str(replicas), "--router", router, "--cpus-per-replica", "1"]
    else:
        cmd += ["--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {' '.join(cmd)}")
        time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def cache_counts(url: str) -> tuple[int, int]:
    """(prompt tokens looked up, prompt tokens found) summed over the replicas, or the one engine."""
    stats = httpx.get(url + "/engine/stats", headers={"Authorization": "Bearer key-0"}, timeout=30).json()
    figures = list(stats.get("replicas", {}).values()) or [stats]
    return (sum(f.get("prefix_cache_queries", 0) for f in figures),
            sum(f.get("prefix_cache_hits", 0) for f in figures))


async def send_all(urls: list[str], jobs: list[tuple[int, str]], max_tokens: int, concurrency: int) -> dict:
    """Every job through /v1/completions, `concurrency` at a time, job i to urls[i % len(urls)]
    (one URL: the server routes; two: the client splits, as two plain servers need): tokens, TTFTs, wall."""
    gate, ttfts, tokens = asyncio.Semaphore(concurrency), [], []
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(url: str, tenant: int, prompt: str) -> None:
            async with gate:
                r = await client.post(url + "/v1/completions", headers={"Authorization": f"Bearer key-{tenant}"},
                                      json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
                r.raise_for_status()
                body = r.json()
                ttfts.append(body["metrics"]["ttft_ms"])
                tokens.append(body["usage"]["completion_tokens"])
        t0 = time.perf_counter()
        await asyncio.gather(*(one(urls[i % len(urls)], t, p) for i, (t, p) in enumerate(jobs)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(tokens) / wall, "ttft_ms": statistics.median(ttfts), "wall_s": wall}


def run_config(replicas: int, router: str, jobs, args, max_tokens: int, concurrency: int,
               servers: int = 1) -> dict:
    """One configuration, started fresh: `servers` copies of the server (replicas 0: no Ray)."""
    started = [start_server(replicas, router, args) for _ in range(servers)]
    urls = [url for _, url in started]
    try:
        asyncio.run(send_all(urls, [(0, "Warm up the replicas.")] * 4 * servers, 2, 4))   # first steps are slow
        before = [cache_counts(url) for url in urls]
        result = asyncio.run(send_all(urls, jobs, max_tokens, concurrency))
        after = [cache_counts(url) for url in urls]
    finally:
        for proc, _ in started:
            stop_server(proc)
    queried = sum(a[0] - b[0] for a, b in zip(after, before))
    hit = sum(a[1] - b[1] for a, b in zip(after, before))
    return {**result, "cached_share": hit / queried if queried else 0.0}


# --8<-- [start:tenants]
def measure_tenants(args) -> None:
    jobs = workload(args.seed)
    rows = {}
    for name, replicas, router in (("prefix, 2 replicas", 2, "prefix"), ("pow2, 2 replicas", 2, "pow2"),
                                   ("1 replica", 1, "pow2")):
        rows[name] = r = run_config(replicas, router, jobs, args, args.max_tokens, concurrency=4)
        print(f"{name:20s} cached share {r['cached_share']:.2f}  {r['tokens_per_s']:6.1f} tokens/s  "
              f"TTFT median {r['ttft_ms']:7.0f} ms", flush=True)
    ratio = rows["prefix, 2 replicas"]["cached_share"] / max(rows["pow2, 2 replicas"]["cached_share"], 1e-9)
    print(f"prefix-aware / power of two choices, cached share: {ratio:.2f}x")
# --8<-- [end:tenants]


# --8<-- [start:throughput]
def measure_throughput(args) -> None:
    """32 distinct short prompts on 1 replica, on 2 (one CPU each), and on two plain servers of one
    thread each with no Ray (what Ray itself costs), alternating; the median ratio of repeats."""
    jobs = [(n % TENANTS, f"Request {n}: write a short note about the number {n}.") for n in range(32)]
    configs = {"1 replica": (1, 1), "2 replicas": (2, 1), "2 plain servers": (0, 2)}   # (replicas, servers)
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (replicas, servers) in configs.items():
            r = run_config(replicas, "pow2", jobs, args, args.max_tokens, concurrency=32, servers=servers)
            runs[name].append(r["tokens_per_s"])
            print(f"{name:16s} {r['tokens_per_s']:6.1f} tokens/s", flush=True)
    for base in ("1 replica", "2 plain servers"):
        ratios = [b / a for a, b in zip(runs[base], runs["2 replicas"])]
        print(f"2 replicas / {base}: {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}, {args.repeats} alternating runs)")
# --8<-- [end:throughput]


def main() -> None:
    parser = argparse.ArgumentParser(description="Replicas of the engine on Ray Serve, and the prefix router.")
    parser.add_argument("--measure", choices=("tenants", "throughput"), default=None)
    parser.add_argument("--model", default=None, help="the model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-memory", default="110MB", help="each replica's KV pool (default: 2,496 tokens, five system prompts)")
    parser.add_argument("--max-tokens", type=cli.integer(1, 512), default=16)
    parser.add_argument("--repeats", type=cli.integer(1, 20), default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.measure is None:
        show_choices()
    elif args.measure == "tenants":
        measure_tenants(args)
    else:
        measure_throughput(args)
    print(f"[machine] {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
