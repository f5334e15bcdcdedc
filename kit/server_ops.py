"""kit/server_ops.py - the server's production face, kept out of 05_server.py's API logic.

What every production server (vLLM, TGI, llama.cpp's server) adds around its API, here
in one place that `make_app` installs with one call:

- Admission: `AdmissionQueue`, the one place where requests wait for the engine (a FIFO lock
  for one-at-a-time engines) and where `--max-waiting` refuses them with 503 and Retry-After.
- API keys: `--api-key` / ENGINE_API_KEY guards every /v1/* route (401 in OpenAI's shape), and
  the page's /engine/stats and /engine/scheduler too, where a tenant's key sees its own requests
  only; /metrics, the whole service's counts, takes only `--metrics-key` (Prometheus') or
  `--admin-key` (the instructor's), which read every view. `--max-waiting-per-key` is one key's share.
- Host names: only those the server was bound for (`--allowed-hosts`), against DNS rebinding.
- Prometheus metrics at GET /metrics: requests (by route, never by raw path), tokens, TTFT,
  inter-token latency, queue time, and the engine's features.
- Timeouts: a request body must arrive within `--body-timeout` seconds; a request that runs too
  long is ended, with an error the client sees: past `--request-timeout` seconds, or by default
  past a bound sized from its token budget (`time_limit`).
- Graceful shutdown: SIGTERM/Ctrl-C stops accepting, lets running requests finish for
  `--shutdown-grace` seconds, ends the rest with a final error event, and exits 0.
- With `--access-log`, one log line per request (never the prompt text; control characters
  escaped). Off by default: a class of thirty streams writes a hundred lines a second.
- The classroom page at GET / (static/), fed by GET /engine/stats and GET /engine/scheduler, and
  the URLs to give a class, printed as the server starts (`startup_lines`).

One ASGI middleware times every request at the HTTP boundary, and the endpoints tell it the
token counts they already hold (`piece_sent`, `answered`), so nothing they wrote is parsed again.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool

from kit import cli, engine_view
from kit.adapter_routes import RUNTIME_ROUTES

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
OTHER_ROUTE = "other"        # the metrics' one label for every path no route serves
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
CLIENT_CLOSED = 499          # nginx's status for "the client closed the request"
RATE_WINDOW_S = 5.0          # "tokens/s over the last seconds" on the page and in /engine/stats
access_log = logging.getLogger("05_server.access")

# Latency buckets from 5 ms to 2 min: a tiny model on a GPU up to a long answer on a laptop CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(eq=False)   # hashed by identity: ServerOps.active is a set of them
class RequestRecord:
    """What the middleware and the endpoint learn about one request while it runs."""
    route: str                   # the path as sent (the access log escapes it)
    ops: ServerOps
    endpoint: str = OTHER_ROUTE  # the route it matched: the metrics' label, one per route
    start: float = field(default_factory=time.monotonic)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    status: int = 0
    streamed: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0        # speculative decoding (Chapter 10): guesses verified, and kept
    accepted_tokens: int = 0
    pieces: int = 0              # text pieces streamed so far (about one token each)
    budget_tokens: int = 0       # the tokens its prompts may generate in all: its default time bound
    ttft_s: float | None = None
    tenant: str | None = None    # which API key sent it (keys are tenants: their prefix caches are apart)
    queue_s: float | None = None
    last_event: float | None = None
    error: str | None = None
    answered: bool = False       # the engine's results came back (else it ended early)
    response_started: bool = False
    response_done: bool = False
    taken_over: bool = False     # the middleware ended the response itself (timeout, shutdown)
    cancel: anyio.CancelScope | None = None
    # asyncio's, not anyio's: uncontended it takes no checkpoint, so a cancellation (a client
    # hanging up) still lands in the endpoint's generators, whose clean-up frees the engine.
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("request", default=None)


# --8<-- [start:counts]
# The endpoint holds the counts (the GenerateResult's metrics) and knows when each piece goes
# out; it tells this request's record here. Outside a request (no middleware) they do nothing.
def piece_sent() -> None:
    """A streamed text piece goes out now: the first one is the TTFT, each later one an inter-token gap."""
    rec = _current.get()
    if rec is None:
        return
    now = time.monotonic()
    if rec.ttft_s is None:
        rec.ttft_s = now - rec.start
    else:
        rec.ops.metrics.itl.observe(now - rec.last_event)
    rec.last_event, rec.pieces = now, rec.pieces + 1
    rec.ops.generated(1)


def answered(results: list) -> None:
    """The request's GenerateResults: its token counts, and for a reply that was not streamed, its TTFT."""
    rec = _current.get()
    if rec is None:
        return
    rec.answered = True
    rec.prompt_tokens = sum(r.metrics.input_tokens for r in results)
    rec.output_tokens = sum(r.metrics.output_tokens for r in results)
    rec.draft_tokens = sum(r.metrics.draft_tokens or 0 for r in results)
    rec.accepted_tokens = sum(r.metrics.accepted_tokens or 0 for r in results)
    rec.ops.generated(rec.output_tokens - rec.pieces)   # a piece may have held several tokens
    ttfts = [r.metrics.ttft_ms for r in results]
    if rec.ttft_s is None and ttfts and None not in ttfts:   # the engine's, after the wait for its turn
        rec.ttft_s = (rec.queue_s or 0.0) + min(ttfts) / 1000


def viewer() -> str | None:
    """The tenant whose key asked for this view (None: the admin or metrics key, or no keys)."""
    rec = _current.get()
    return rec.tenant if rec is not None else None


def tenant_salt(cache_salt: str | None) -> str | None:
    """The prefix-cache salt for this request: its API key's tenant, with the client's own
    cache_salt inside it, so no key's requests ever share cached blocks with another key's."""
    rec = _current.get()
    tenant = rec.tenant if rec is not None else None
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


def failed(message: str, status: int) -> None:
    """An error the client was told inside a 200 stream: the access log and /metrics say it too."""
    rec = _current.get()
    if rec is not None:
        rec.error, rec.status = message, status


def budget_set(n_tokens: int) -> None:
    """The tokens the request may generate in all (every prompt's budget): its default time bound."""
    rec = _current.get()
    if rec is not None:
        rec.budget_tokens = n_tokens


def prompt_read(n_tokens: int) -> None:
    """The request's prompt tokens, counted before it runs: an answer cut short still reports them."""
    rec = _current.get()
    if rec is not None:
        rec.prompt_tokens = n_tokens


def cut_short(output_tokens: int | None) -> None:
    """The request ended before its results came back (its client left, a timeout, the shutdown):
    count the tokens it did generate, or, where the engine cannot say, the pieces it streamed."""
    rec = _current.get()
    if rec is not None and not rec.answered:
        rec.output_tokens = rec.pieces if output_tokens is None else output_tokens
        rec.ops.generated(rec.output_tokens - rec.pieces)
# --8<-- [end:counts]


class Metrics:
    """Prometheus metrics in their own registry, so every app (and every test) counts alone."""

    def __init__(self, snapshot):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llm_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "tokens generated", registry=r)
        self.draft_tokens = Counter("llm_spec_decode_draft_tokens", "guessed tokens verified", registry=r)
        self.accepted_tokens = Counter("llm_spec_decode_accepted_tokens", "guessed tokens kept", registry=r)
        hist = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = hist("llm_time_to_first_token_seconds", "time to first token")
        self.itl = hist("llm_inter_token_latency_seconds", "time between streamed tokens")
        self.e2e = hist("llm_e2e_request_latency_seconds", "whole request, arrival to last byte")
        self.queue = hist("llm_request_queue_time_seconds", "time waiting for the engine")
        r.register(_SnapshotCollector(snapshot))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges read at scrape time from the admission queue and, where it has them, the engine's
    stats() and features()."""
    GAUGES = {"waiting": "llm_requests_waiting", "running": "llm_requests_running",
              "kv_blocks_used": "llm_kv_blocks_used", "kv_blocks_free": "llm_kv_blocks_free",
              "prefix_cache_hit_rate": "llm_prefix_cache_hit_rate"}

    COUNTERS = {"aborted": ("llm_requests_aborted", "requests stopped before they finished"),
                "preemptions": ("llm_preemptions", "requests preempted for want of KV blocks")}

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        for key, name in self.GAUGES.items():
            if isinstance(snap.get(key), (int, float)):
                yield GaugeMetricFamily(name, key.replace("_", " "), value=snap[key])
        for key, (name, text) in self.COUNTERS.items():   # totals the engine keeps: counters
            if isinstance(snap.get(key), int):
                yield CounterMetricFamily(name, text, value=snap[key])
        yield from self.per_replica(snap.get("replicas"))
        features = snap.get("features")
        if features:   # Prometheus' "info" idiom: the settings as labels of a gauge that is always 1
            info = GaugeMetricFamily("llm_engine_features", "the engine's features, one label each",
                                     labels=list(features))
            info.add_metric([_label(v) for v in features.values()], 1)
            yield info


    REPLICA_COUNTERS = {**{k: v for k, v in COUNTERS.items()},
                        "prefix_cache_queries": ("llm_prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
                        "prefix_cache_hits": ("llm_prefix_cache_hits", "prompt tokens the prefix cache held")}

    def per_replica(self, replicas: dict | None):
        """Chapter 18: each replica's last report, its series labelled `replica`."""
        if not replicas:
            return
        for key, name in self.GAUGES.items():
            family = GaugeMetricFamily(f"{name}_by_replica", f"{key.replace('_', ' ')}, per replica", labels=["replica"])
            for replica, stats in replicas.items():
                if isinstance(stats.get(key), (int, float)):
                    family.add_metric([str(replica)], stats[key])
            yield family
        for key, (name, text) in self.REPLICA_COUNTERS.items():
            family = CounterMetricFamily(f"{name}_by_replica", f"{text}, per replica", labels=["replica"])
            for replica, stats in replicas.items():
                if isinstance(stats.get(key), int):
                    family.add_metric([str(replica)], stats[key])
            yield family


def _label(value) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


class Overloaded(Exception):
    pass


# --8<-- [start:admission]
class AdmissionQueue:
    """Where requests wait for the engine, and where --max-waiting refuses them (503).

    Chapter 1's engines serve one request at a time, so a request takes its turn behind an
    asyncio.Lock, which wakes its waiters in arrival order (FIFO), and holds it for its whole
    generation, streams included. An engine that batches live requests itself (Chapter 9's
    `submit`) gets no lock: every request goes straight to its scheduler, which runs up to
    `seats` (max_num_seqs) of them at once. What max_waiting bounds there is what waits beyond
    those seats: the engine holds at most seats + max_waiting requests, running or queued.
    Requests still being tokenised are not the engine's yet and do not count.
    """

    def __init__(self, max_waiting: int | None, on_queued: Callable[[float], None],
                 engine_load: Callable[[], tuple[int, int]] | None = None, seats: int = 0,
                 max_waiting_per_key: int | None = None):
        self._lock = None if engine_load else asyncio.Lock()
        self.max_waiting, self.on_queued, self.engine_load, self.seats = max_waiting, on_queued, engine_load, seats
        self.waiting = self.running = 0
        self.per_key, self.held = max_waiting_per_key, collections.Counter()   # tenant -> its prompts held

    def check_key(self, tenant: str | None, prompts: int) -> None:
        """One API key's share: its prompts held (running or waiting) stay within the engine's seats
        (one for Chapter 1's) plus max_waiting_per_key, so one key cannot fill the queue for all."""
        if self.per_key is None or tenant is None:
            return
        room = max(self.seats, 1) + self.per_key
        if self.held[tenant] + prompts > room:
            raise Overloaded(f"this API key already has {self.held[tenant]} requests at the server, and one key "
                             f"may have {room} (--max-waiting-per-key {self.per_key} beyond the engine's seats)")

    def check_engine(self, prompts: int) -> None:
        """Refuse (Overloaded) a request the batching engine has no room for: seats + max_waiting."""
        if self.max_waiting is None:
            return
        running, waiting = self.engine_load()   # both counted by the engine: its queue and its batch
        held, room = running + waiting, self.seats + self.max_waiting
        if prompts > room:
            raise Overloaded(f"a list of {prompts} prompts is more than this server takes at once "
                             f"({self.seats} running + --max-waiting {self.max_waiting}); send at most {room}")
        if held + prompts > room:
            raise Overloaded(f"the server is overloaded: {running} requests run on the engine's {self.seats} "
                             f"seats and {waiting} wait for one (--max-waiting {self.max_waiting})")

    @contextlib.asynccontextmanager
    async def turn(self, prompts: int = 1) -> AsyncIterator[None]:
        """Hold the request's place at the engine while the block runs; a list takes one turn.

        With a batching engine the caller must hand its prompts over before its next await:
        the engine's count is then exact for whoever is admitted next."""
        tenant = viewer()
        self.check_key(tenant, prompts)
        if self._lock is None:
            self.check_engine(prompts)
        elif self.max_waiting is not None and self._lock.locked() and self.waiting >= self.max_waiting:
            raise Overloaded(f"the server is overloaded: {self.waiting} requests are already waiting")
        self.held[tenant] += prompts   # the key's share, from its wait for the lock to its answer's end
        try:
            if self._lock is not None:
                self.waiting += 1
                t0 = time.monotonic()
                try:
                    await self._lock.acquire()
                finally:
                    self.waiting -= 1
                self.on_queued(time.monotonic() - t0)
            self.running += 1
            try:
                yield
            finally:
                self.running -= 1
                if self._lock is not None:
                    self._lock.release()
        finally:
            self.held[tenant] -= prompts
# --8<-- [end:admission]


@dataclass
class ServerOps:
    """The production settings; `install` wires them into an app."""
    api_key: str | tuple[str, ...] | None = None   # one key, or several: each key is a tenant
    metrics_key: str | None = None   # /metrics and /engine/*; None: the api_keys guard /engine/*
    admin_key: str | None = None     # the whole service's views: /metrics and /engine/*, never a tenant
    allowed_hosts: tuple[str, ...] | None = None   # Host header names served; None: any
    max_waiting: int | None = None
    max_waiting_per_key: int | None = None   # one API key's requests beyond the engine's seats; None: no bound
    request_timeout: float | None = None
    body_timeout: float = 30.0
    shutdown_grace: float = 10.0
    retry_after_s: int = 1
    access_log: bool = False         # one line per request on the log: off unless asked (--access-log)

    def __post_init__(self):
        keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())
        if len(keys) > MAX_API_KEYS or any(not k or not k.isprintable() or " " in k for k in keys) \
                or len(set(keys)) != len(keys):
            raise ValueError(f"API keys must be distinct printable words without spaces, at most {MAX_API_KEYS}")
        self.api_keys = keys
        for name in ("metrics_key", "admin_key"):   # a tenant holding it would read every other tenant's views
            if getattr(self, name) is not None and getattr(self, name) in keys:
                raise ValueError(f"{name} must differ from every API key: a tenant would see the whole service")
        for name in ("max_waiting", "max_waiting_per_key", "request_timeout", "shutdown_grace", "body_timeout"):
            value = getattr(self, name)
            if value is not None and not (0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.allowed_hosts is not None:
            self.allowed_hosts = tuple(host_name(h) for h in self.allowed_hosts)
        self.active: set[RequestRecord] = set()
        self.shutting_down = False
        self._tokens: collections.deque = collections.deque()   # (time, tokens) for the live rate
        self._served = 0

    # --8<-- [start:time-limit]
    def time_limit(self, rec: RequestRecord) -> float:
        """How long a generation may run: --request-timeout if given, else a bound from its budget,
        slow enough for a busy laptop CPU (AUTO_TIMEOUT_PER_TOKEN_S a token), so that no request,
        a list of 64 prompts included, holds the engine without end."""
        if self.request_timeout:
            return self.request_timeout
        return min(MAX_TIMEOUT_S, AUTO_TIMEOUT_BASE_S + AUTO_TIMEOUT_PER_TOKEN_S * rec.budget_tokens)
    # --8<-- [end:time-limit]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerOps":
        keys = list(args.api_key or ([os.environ["ENGINE_API_KEY"]] if os.environ.get("ENGINE_API_KEY") else []))
        if getattr(args, "api_keys_file", None):
            keys += [line.strip() for line in open(args.api_keys_file, encoding="utf-8")
                     if line.strip() and not line.lstrip().startswith("#")]
        return cls(api_key=tuple(keys) or None, metrics_key=args.metrics_key or None,
                   admin_key=args.admin_key or None,
                   allowed_hosts=served_hosts(args.host, args.allowed_hosts), max_waiting=args.max_waiting,
                   max_waiting_per_key=getattr(args, "max_waiting_per_key", None),
                   request_timeout=args.request_timeout, body_timeout=args.body_timeout,
                   shutdown_grace=args.shutdown_grace, access_log=args.access_log)

    # --8<-- [start:install]
    def install(self, app: FastAPI, engine, api_error: type) -> None:
        """Add the middleware, /metrics, /engine/stats and the page, and the engine's `admission` queue."""
        self.app, self.engine, self.api_error = app, engine, api_error
        can = engine.capabilities()   # an engine that schedules itself is admitted by its seats
        self.admission = AdmissionQueue(self.max_waiting, self._queued, (lambda: engine_load(engine))
                                        if can.schedules_itself else None, seats=can.max_num_seqs or 0,
                                        max_waiting_per_key=self.max_waiting_per_key)
        self.metrics = Metrics(self.snapshot)
        app.add_middleware(_OpsMiddleware, ops=self)

        async def overloaded(_, exc: Overloaded) -> JSONResponse:
            body = api_error(503, f"{exc}; retry in a moment", type_="server_error").body()
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.retry_after_s)})
        app.add_exception_handler(Overloaded, overloaded)

        @app.get("/metrics", include_in_schema=False)
        async def metrics():   # formatting every series takes a while: not on the event loop
            return Response(await run_in_threadpool(self.metrics.text), media_type=CONTENT_TYPE_LATEST)

        @app.get("/engine/stats")
        async def engine_stats():
            return self.snapshot()
        engine_view.install(app, engine, viewer)   # GET /engine/scheduler: requests, KV blocks, steps (Chapter 9)

        @app.get("/", include_in_schema=False)
        async def page():
            return FileResponse(STATIC_DIR / "index.html")
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    # --8<-- [end:install]

    def endpoint(self, path: str) -> str:
        """The route a path matches, as declared ('/v1/completions', '/static'), or 'other': the
        metrics' label. A label per raw path would let any client add series without end."""
        for route in self.app.routes:
            regex = getattr(route, "path_regex", None)
            if regex is not None and regex.match(path):
                return route.path or OTHER_ROUTE
        return OTHER_ROUTE

    def snapshot(self) -> dict:
        """What the live panel shows: the queue's counts, overridden by the engine's own stats(),
        and the features the engine was built with (Chapter 12's quant, Chapter 8's prefix caching...)."""
        now = time.monotonic()
        while self._tokens and now - self._tokens[0][0] > RATE_WINDOW_S:
            self._tokens.popleft()
        snap = {"engine": type(self.engine).__name__, "waiting": self.admission.waiting,
                "running": self.admission.running, "served": self._served,
                "tokens_per_s": round(sum(n for _, n in self._tokens) / RATE_WINDOW_S, 2),
                "window_s": RATE_WINDOW_S, "shutting_down": self.shutting_down}
        snap.update(self.engine.stats())   # e.g. batch_sizes of recent steps, kv_blocks_used/free
        features = self.engine.features()
        if features:   # Chapter 1's engines were built with nothing to show
            snap["features"] = features
        return snap

    def _queued(self, seconds: float) -> None:
        self.metrics.queue.observe(seconds)
        rec = _current.get()
        if rec is not None:
            rec.queue_s = seconds

    def generated(self, n: int) -> None:
        """n tokens went out now: the live tokens/s."""
        if n > 0:
            self._tokens.append((time.monotonic(), n))

    # --8<-- [start:shutdown]
    async def shutdown(self) -> None:
        """Let running requests finish for shutdown_grace seconds, then end the rest with an error."""
        self.shutting_down = True
        deadline = time.monotonic() + self.shutdown_grace
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rec in list(self.active):
            await self._end(rec, 503, "the server is shutting down; this request was ended")
    # --8<-- [end:shutdown]

    async def _end(self, rec: RequestRecord, status: int, message: str) -> None:
        """Finish a response from outside the endpoint, then cancel the endpoint (freeing its work)."""
        async with rec.send_lock:
            if rec.response_done or rec.taken_over:
                return
            rec.taken_over, rec.error = True, message
            body = self.api_error(status, message, type_="server_error").body()
            send, started, rec.status = rec.send, rec.response_started, status   # the outcome, 200 sent or not
            if not started:
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            elif rec.streamed:   # too late for a status: a final error event, then [DONE]
                data = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": data, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            rec.response_done = True
        if rec.cancel is not None:
            rec.cancel.cancel()

    def authorized(self, headers: dict[bytes, bytes], path: str) -> bool | str:
        """The keys this path takes, if any: the API keys for /v1/*; the metrics key (or else the API
        keys) for /metrics, /engine/stats and /engine/scheduler, which tell how busy the server is
        and what it runs. True where no key is needed; else the tenant of the key given
        ("key-2" for the third --api-key), or False."""
        # --8<-- [start:views]
        service = tuple(k for k in (self.metrics_key, self.admin_key) if k)   # keys that see every tenant
        if path in RUNTIME_ROUTES:   # the server reads a folder of adapters: the instructor's key only
            keys = (self.admin_key,) if self.admin_key else ("",)   # no admin key: nobody
        elif path.startswith("/v1/"):
            keys = self.api_keys
        elif path == "/metrics":   # every tenant's counts and latencies: never a tenant's key
            keys = service or (("",) if self.api_keys else ())   # keyed tenants, no service key: nobody
        elif path in ("/engine/stats", "/engine/scheduler"):
            keys = service if self.metrics_key else self.api_keys + service
        else:
            keys = ()
        # --8<-- [end:views]
        if not keys:
            return True
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        # The scheme is case-insensitive (RFC 9110: "bearer" is "Bearer"). Constant time: how
        # long a wrong key takes must not tell how much of it was right, nor which key it was near.
        matches = [bool(key) and hmac.compare_digest(given.strip(), key.encode()) for key in keys]
        if scheme.lower() != b"bearer" or not any(matches):
            return False
        index = matches.index(True)
        return f"key-{index}" if keys[index] in self.api_keys and keys[index] not in service else True

    def host_allowed(self, headers: dict[bytes, bytes]) -> bool:
        """Against DNS rebinding: a web page whose name an attacker points at 127.0.0.1 reaches a
        loopback server, but its requests still carry the attacker's name in the Host header."""
        if self.allowed_hosts is None:
            return True
        return host_name(headers.get(b"host", b"").decode("latin-1")) in self.allowed_hosts


def host_name(host: str) -> str:
    """A Host header's (or --host's) name without the port: 'LocalHost:8001' -> 'localhost',
    '[::1]:8001' and '::1' -> '[::1]'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return f"[{host}]" if host.count(":") > 1 else host.split(":")[0]


def served_hosts(bound: str, allowed: str | None) -> tuple[str, ...] | None:
    """The Host names served: --allowed-hosts ('*' is any), else this machine's loopback names
    and --host itself; a server bound to every interface (0.0.0.0) answers to any name."""
    if allowed is not None:
        names = [h for h in allowed.split(",") if h.strip()]
        return None if "*" in (h.strip() for h in names) else tuple(names)
    if bound.strip() in WILDCARD_HOSTS:
        return None
    return (*LOOPBACK_HOSTS, bound)


# --8<-- [start:urls]
def lan_addresses(family: int = socket.AF_INET) -> list[str]:
    """This machine's addresses that another machine on the network can reach, best first.

    Two ways, both with no traffic: the address the machine would send from to reach the
    outside (a UDP socket's connect only picks a route; nothing is sent), then every address
    its host name resolves to. Loopback ones (127.x, ::1; Debian maps the host name to
    127.0.1.1) and IPv6 link-local ones (fe80::, which need an interface name) reach nobody."""
    found = []
    probe = "198.51.100.1" if family == socket.AF_INET else "2001:db8::1"   # documentation addresses: nobody's
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((probe, 9))
        found.append(sock.getsockname()[0])
    with contextlib.suppress(OSError):   # no name service (an offline laptop): the route's answer, or none
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, family)]
    reachable = [a for a in found if not ipaddress.ip_address(a.split("%")[0]).is_loopback
                 and not ipaddress.ip_address(a.split("%")[0]).is_link_local]
    return list(dict.fromkeys(reachable))   # without repeats, in the order found


def url_host(address: str) -> str:
    """An address as a URL writes it: an IPv6 one in brackets (http://[fd00::2]:8001/)."""
    address = address.strip().strip("[]")
    return f"[{address}]" if ":" in address else address


def page_urls(host: str, port: int, addresses: Callable[[int], list[str]] = lan_addresses) -> list[str]:
    """The page's URL(s) to give students. Bound to every interface (0.0.0.0, or :: for IPv6 too),
    the server has no one name: each LAN address is a URL (an empty list: nothing but this machine
    reaches it). Bound to one address, that address (127.0.0.1: this machine only)."""
    if host.strip() in WILDCARD_HOSTS:
        families = (socket.AF_INET, socket.AF_INET6) if ":" in host else (socket.AF_INET,)
        return [f"http://{url_host(a)}:{port}/" for family in families for a in addresses(family)]
    return [f"http://{url_host(host)}:{port}/"]


def startup_lines(engine_spec: str, host: str, port: int, api_key: str | None = None,
                  addresses: Callable[[int], list[str]] = lan_addresses) -> str:
    """What the server prints as it starts: the URL(s) students open, and the API's base URL."""
    urls = page_urls(host, port, addresses)
    every = host.strip() in WILDCARD_HOSTS
    lines = [f"[server] {engine_spec} on " + (f"every interface, port {port}" if every else f"{url_host(host)}:{port}")]
    if every and not urls:
        lines.append("[server] no network address found: only this machine reaches the page")
    lines += [f"[server] {'the page' if i == 0 else '      or'}: {u}" for i, u in enumerate(urls)]
    if every:   # the instructor's own browser, whatever the network
        lines.append(f"[server] on this machine: http://127.0.0.1:{port}/")
    lines.append(f"[server] API base URL: {(urls or [f'http://127.0.0.1:{port}/'])[0]}v1")
    if api_key:
        lines.append("[server] --api-key is set: the page asks for the key once; give it to the class")
    elif not is_loopback(host):   # the README's classroom command without its key: say so, loudly
        lines.append(f"[server] WARNING: bound to {'every interface' if every else url_host(host)} with no --api-key: "
                     "anyone who reaches this port may use the engine and read its pages; add --api-key KEY")
    return "\n".join(lines)


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches: localhost, 127.x, ::1."""
    name = host_name(host)
    if name in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:   # a host name: it may resolve to anything
        return False
# --8<-- [end:urls]


def engine_load(engine) -> tuple[int, int]:
    """A batching engine's requests: (running, waiting) as its stats() counts them."""
    stats = engine.stats()
    return stats.get("running", 0), stats["waiting"]


def printable(text: str) -> str:
    """Text for a log line: control characters escaped, so that a path cannot forge or break lines."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


class _OpsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so the endpoint runs in this task and sees `_current`."""

    def __init__(self, app, ops: ServerOps):
        self.app, self.ops = app, ops

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ops, path = self.ops, scope["path"]
        headers = dict(scope.get("headers") or [])
        rec = RequestRecord(route=path, ops=ops, endpoint=ops.endpoint(path))
        refusal = None
        if not ops.host_allowed(headers):
            refusal = JSONResponse(ops.api_error(400, "this server does not answer to that Host name; "
                                                      "start it with --allowed-hosts to add one").body(), 400)
        elif not (allowed := ops.authorized(headers, path)):
            body = ops.api_error(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                 type_="invalid_request_error").body()
            body["error"]["code"] = "invalid_api_key"
            refusal = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if refusal is not None:
            await refusal(scope, receive, send)
            rec.status = refusal.status_code
            return self._finish(rec)
        rec.tenant = allowed if isinstance(allowed, str) else None
        rec.send = send
        if ops.shutting_down and path in GENERATION_ROUTES:
            await ops._end(rec, 503, "the server is shutting down")
            return self._finish(rec)
        token = _current.set(rec)
        generation = path in GENERATION_ROUTES

        async def guarded_send(message):
            async with rec.send_lock:
                if rec.taken_over:      # the middleware already answered: drop the endpoint's bytes
                    return
                if message["type"] == "http.response.start":
                    rec.response_started, rec.status = True, message["status"]
                    ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                    rec.streamed = ctype.startswith(b"text/event-stream")
                elif message["type"] == "http.response.body":
                    rec.response_done = not message.get("more_body", False)
                await send(message)

        try:
            async with anyio.create_task_group() as tg:
                if generation:
                    ops.active.add(rec)
                    tg.start_soon(self._deadline, rec)   # always: a fixed bound, or one from the budget
                with anyio.CancelScope() as rec.cancel:
                    await self.app(scope, receive, guarded_send)
                tg.cancel_scope.cancel()
        finally:
            ops.active.discard(rec)
            _current.reset(token)
            self._finish(rec)

    async def _deadline(self, rec: RequestRecord) -> None:
        while (left := rec.start + self.ops.time_limit(rec) - time.monotonic()) > 0:
            await anyio.sleep(min(left, 1.0))   # the budget is learnt after the body: read the bound again
        limit = self.ops.time_limit(rec)
        why = (f"--request-timeout {limit:g}s" if self.ops.request_timeout else
               f"its time bound, {limit:g}s for {rec.budget_tokens} tokens (--request-timeout sets another)")
        await self.ops._end(rec, 504, f"the request ran longer than {why} and was ended")

    def _finish(self, rec: RequestRecord) -> None:
        ops, total = self.ops, time.monotonic() - rec.start
        m = ops.metrics
        if rec.route in GENERATION_ROUTES and rec.status == 200 and not rec.answered:
            rec.status = CLIENT_CLOSED   # a stream whose client left: its 200 went out, its answer did not
        m.requests.labels(rec.endpoint, str(rec.status)).inc()
        if rec.route in GENERATION_ROUTES:
            m.prompt_tokens.inc(rec.prompt_tokens)
            m.generation_tokens.inc(rec.output_tokens)
            m.draft_tokens.inc(rec.draft_tokens)
            m.accepted_tokens.inc(rec.accepted_tokens)
            m.e2e.observe(total)
            if rec.ttft_s is not None:
                m.ttft.observe(rec.ttft_s)
            if rec.status == 200:
                ops._served += 1
        if not ops.access_log:
            return
        ttft = f"{rec.ttft_s * 1000:.0f}ms" if rec.ttft_s is not None else "-"
        queue = f"{rec.queue_s * 1000:.0f}ms" if rec.queue_s is not None else "-"
        access_log.info("%s %s %d prompt=%d output=%d queue=%s ttft=%s total=%.0fms%s", rec.id, printable(rec.route),
                        rec.status, rec.prompt_tokens, rec.output_tokens, queue, ttft, total * 1000,
                        f" error={rec.error!r}" if rec.error else "")


MAX_TIMEOUT_S = 24 * 3600   # every number bounded: a day is longer than any request here
AUTO_TIMEOUT_BASE_S = 60.0        # the default bound: a minute, plus
AUTO_TIMEOUT_PER_TOKEN_S = 0.5    # half a second per token of the request's budget (2 tokens/s at worst)
MAX_API_KEYS = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", action="append", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* and, unless --metrics-key is given, "
                             "on /metrics and /engine/stats (default: $ENGINE_API_KEY). Repeat it for several "
                             "keys: each key is a tenant, whose requests never share prefix-cache blocks with "
                             "another key's")
    parser.add_argument("--api-keys-file", default=None, metavar="FILE",
                        help="more API keys, one per line (# starts a comment): one tenant each")
    parser.add_argument("--metrics-key", default=os.environ.get("ENGINE_METRICS_KEY"),
                        help="the key for /metrics and /engine/*, e.g. Prometheus' (default: $ENGINE_METRICS_KEY; "
                             "without it /engine/* takes --api-key, /metrics only --admin-key, and with no key "
                             "at all they are open)")
    parser.add_argument("--admin-key", default=os.environ.get("ENGINE_ADMIN_KEY"),
                        help="the instructor's or operator's key: reads /metrics and /engine/* for the whole "
                             "service (default: $ENGINE_ADMIN_KEY); a tenant's --api-key never reads /metrics")
    parser.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                        help="Host header names to answer, comma-separated, '*' for any (default: localhost, "
                             "127.0.0.1, [::1] and --host; any name when --host is 0.0.0.0)")
    parser.add_argument("--max-waiting", type=cli.integer(0), default=None,
                        help="requests allowed to wait beyond those the engine runs (a batching engine's "
                             "--max-num-seqs, else one); past it: 503 (default: no bound)")
    parser.add_argument("--max-waiting-per-key", type=cli.integer(0), default=None,
                        help="one API key's share: its requests at the server, running or waiting, at most the "
                             "engine's seats plus this many; past it: 503 for that key only (default: no bound)")
    parser.add_argument("--request-timeout", type=cli.number(above=0, high=MAX_TIMEOUT_S), default=None,
                        help="end a request that runs longer than this many seconds, streams included, with an "
                             f"error the client sees (default: {AUTO_TIMEOUT_BASE_S:g} s plus "
                             f"{AUTO_TIMEOUT_PER_TOKEN_S:g} s per token of its budget, max_tokens summed over "
                             f"its prompts)")
    parser.add_argument("--body-timeout", type=cli.number(above=0, high=MAX_TIMEOUT_S), default=30.0,
                        help="seconds a client has to send its whole request body; past it: 408 (default: 30)")
    parser.add_argument("--access-log", action="store_true",
                        help="log one line per request: its id, route, status, tokens, queue, TTFT and time, never "
                             "its text (default: off)")
    parser.add_argument("--shutdown-grace", type=cli.number(low=0, high=MAX_TIMEOUT_S), default=10.0,
                        help="seconds running requests get to finish on SIGTERM/Ctrl-C (default: 10)")


# --8<-- [start:serve]
def run_server(app: FastAPI, ops: ServerOps, host: str, port: int) -> None:
    """uvicorn, with our access log instead of its own and a graceful shutdown on SIGTERM."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    class Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame) -> None:
            Server.signals += 1
            if Server.signals > 1:   # a second signal: the operator will not wait for the drain
                # Now, and without the interpreter's teardown, which would destroy threads still
                # inside torch (a C++ abort, "terminate called without an active exception").
                print("[server] second signal: exiting now; requests still running are cut off",
                      file=sys.stderr, flush=True)
                os._exit(1)
            if not ops.shutting_down:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(ops.shutdown()))
            super().handle_exit(sig, frame)

    # uvicorn's own grace is a backstop a little after ours, for anything that ignores cancellation.
    # timeout_keep_alive closes an idle connection; a body that stops half-way is --body-timeout's.
    config = uvicorn.Config(app, host=host, port=port, access_log=False, timeout_keep_alive=5,
                            timeout_graceful_shutdown=int(ops.shutdown_grace) + 5)
    server = Server(config)

    def handed_back(sig, frame) -> None:
        # After its shutdown uvicorn (0.29 on) puts back the handlers it found and raises the
        # signal again, so that by default the process dies of it (exit code -15). The handler
        # it finds is this one: the drain went well, and the process goes on to exit 0. A signal
        # in the moment before uvicorn takes over lands here too, and stops the server.
        server.should_exit = True

    # Only the main thread may set handlers (a test may serve from another: uvicorn skips its own there).
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, handed_back) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(server.serve())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loop.close()
# --8<-- [end:serve]

