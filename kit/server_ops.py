"""kit/server_ops.py - the server's production face, kept out of 05_server.py's API logic.

What every production server (vLLM, TGI, llama.cpp's server) adds around its API, here
in one place that `make_app` installs with one call:

- API keys: `--api-key` / ENGINE_API_KEY guards every /v1/* route (401 in OpenAI's shape).
- Prometheus metrics at GET /metrics: requests, tokens, TTFT, inter-token latency, queue time.
- Overload: `--max-waiting` bounds the queue; past it a request gets 503 and Retry-After at once.
- Timeouts: `--request-timeout` ends a request that runs too long, with an error the client sees.
- Graceful shutdown: SIGTERM/Ctrl-C stops accepting, lets running requests finish for
  `--shutdown-grace` seconds, ends the rest with a final error event, and exits 0.
- One access-log line per request (never the prompt text).
- The classroom page at GET / (static/), fed by GET /engine/stats.

Everything is observed at the HTTP boundary by one ASGI middleware, so the numbers are
what a client sees, and the endpoints in 05_server.py stay as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
RATE_WINDOW_S = 5.0          # "tokens/s over the last seconds" on the page and in /engine/stats
MAX_OBSERVED_BODY = 1 << 20  # a non-streamed reply is parsed for its usage only up to this size
access_log = logging.getLogger("05_server.access")

# Latency buckets from 5 ms to 2 min: a tiny model on a GPU up to a long answer on a laptop CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(eq=False)   # hashed by identity: ServerOps.active is a set of them
class RequestRecord:
    """What the middleware learns about one request while it runs."""
    route: str
    start: float = field(default_factory=time.monotonic)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    status: int = 0
    streamed: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_events: int = 0        # content events seen in a stream (about one token each)
    ttft_s: float | None = None
    queue_s: float | None = None
    last_event: float | None = None
    error: str | None = None
    response_started: bool = False
    response_done: bool = False
    taken_over: bool = False     # the middleware ended the response itself (timeout, shutdown)
    cancel: anyio.CancelScope | None = None
    # asyncio's, not anyio's: uncontended it takes no checkpoint, so a cancellation (a client
    # hanging up) still lands in the endpoint's generators, whose clean-up frees the engine.
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sse_buffer: str = ""
    json_body: bytearray = field(default_factory=bytearray)


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("request", default=None)


class Metrics:
    """Prometheus metrics in their own registry, so every app (and every test) counts alone."""

    def __init__(self, snapshot):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llm_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "tokens generated", registry=r)
        hist = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = hist("llm_time_to_first_token_seconds", "time to first token")
        self.itl = hist("llm_inter_token_latency_seconds", "time between streamed tokens")
        self.e2e = hist("llm_e2e_request_latency_seconds", "whole request, arrival to last byte")
        self.queue = hist("llm_request_queue_time_seconds", "time waiting for the engine")
        r.register(_SnapshotCollector(snapshot))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges read at scrape time from the queue and, where it has one, the engine's stats()."""
    GAUGES = {"waiting": "llm_requests_waiting", "running": "llm_requests_running",
              "kv_blocks_used": "llm_kv_blocks_used", "kv_blocks_free": "llm_kv_blocks_free",
              "prefix_cache_hit_rate": "llm_prefix_cache_hit_rate"}

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        for key, name in self.GAUGES.items():
            if isinstance(snap.get(key), (int, float)):
                yield GaugeMetricFamily(name, key.replace("_", " "), value=snap[key])


class Overloaded(Exception):
    pass


class AdmissionQueue:
    """asyncio.Lock (FIFO) that counts who waits and who runs, and refuses past max_waiting.

    An engine that batches live requests itself (Chapter 9's `submit`) gets no lock: every
    request goes straight to its scheduler, which is where requests wait. What max_waiting
    bounds is then `engine_waiting` (the scheduler's queue length) plus the requests admitted
    here but not yet handed over (still being tokenised), so that a burst, or a list of
    prompts, cannot all pass the check before the first of them reaches the scheduler.
    """

    def __init__(self, max_waiting: int | None, on_queued, engine_waiting: Callable[[], int] | None = None):
        self._lock = None if engine_waiting else asyncio.Lock()
        self.max_waiting, self.on_queued, self.engine_waiting = max_waiting, on_queued, engine_waiting
        self.waiting = self.running = self.handing_over = 0

    async def acquire(self) -> None:
        if self._lock is None:
            waiting = self.engine_waiting() + self.handing_over
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise Overloaded(f"the server is overloaded: {waiting} requests are already waiting")
            self.running += 1
            self.handing_over += 1
            return
        if self.max_waiting is not None and self._lock.locked() and self.waiting >= self.max_waiting:
            raise Overloaded(f"the server is overloaded: {self.waiting} requests are already waiting")
        self.waiting += 1
        t0 = time.monotonic()
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self.on_queued(time.monotonic() - t0)

    def handed_over(self) -> None:
        """The admitted request is in the engine's queue now (or was refused): counted there."""
        self.handing_over -= 1

    def release(self) -> None:
        self.running -= 1
        if self._lock is not None:
            self._lock.release()

    async def __aenter__(self):
        await self.acquire()

    async def __aexit__(self, *exc):
        self.release()


@dataclass
class ServerOps:
    """The production settings; `install` wires them into an app."""
    api_key: str | None = None
    max_waiting: int | None = None
    request_timeout: float | None = None
    shutdown_grace: float = 10.0
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_waiting", "request_timeout", "shutdown_grace"):
            value = getattr(self, name)
            if value is not None and not (0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        self.active: set[RequestRecord] = set()
        self.shutting_down = False
        self._tokens: collections.deque = collections.deque()   # (time, tokens) for the live rate
        self._served = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerOps":
        return cls(api_key=args.api_key or None, max_waiting=args.max_waiting,
                   request_timeout=args.request_timeout, shutdown_grace=args.shutdown_grace)

    # --8<-- [start:install]
    def install(self, app: FastAPI, engine, api_error: type) -> AdmissionQueue:
        """Add the middleware, /metrics, /engine/stats and the page; return the engine's queue."""
        self.engine, self.api_error = engine, api_error
        batching = callable(getattr(engine, "submit", None))
        self.queue = AdmissionQueue(self.max_waiting, self._queued,
                                    (lambda: engine.stats()["waiting"]) if batching else None)
        self.metrics = Metrics(self.snapshot)
        app.add_middleware(_OpsMiddleware, ops=self)

        async def overloaded(_, exc: Overloaded) -> JSONResponse:
            body = api_error(503, f"{exc}; retry in a moment", type_="server_error").body()
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.retry_after_s)})
        app.add_exception_handler(Overloaded, overloaded)

        @app.get("/metrics", include_in_schema=False)
        async def metrics():
            return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/engine/stats")
        async def engine_stats():
            return self.snapshot()

        @app.get("/", include_in_schema=False)
        async def page():
            return FileResponse(STATIC_DIR / "index.html")
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
        return self.queue
    # --8<-- [end:install]

    def snapshot(self) -> dict:
        """What the live panel shows: the queue's counts, overridden by the engine's own stats()."""
        now = time.monotonic()
        while self._tokens and now - self._tokens[0][0] > RATE_WINDOW_S:
            self._tokens.popleft()
        snap = {"engine": type(self.engine).__name__, "waiting": self.queue.waiting,
                "running": self.queue.running, "served": self._served,
                "tokens_per_s": round(sum(n for _, n in self._tokens) / RATE_WINDOW_S, 2),
                "window_s": RATE_WINDOW_S, "shutting_down": self.shutting_down}
        stats = getattr(self.engine, "stats", None)
        if callable(stats):
            snap.update(stats())   # e.g. batch_sizes of recent steps, kv_blocks_used/free
        return snap

    def _queued(self, seconds: float) -> None:
        self.metrics.queue.observe(seconds)
        rec = _current.get()
        if rec is not None:
            rec.queue_s = seconds

    def _generated(self, n: int) -> None:
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
            send = rec.send
            if not rec.response_started:
                rec.status = status
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

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.api_key:
            return True
        given = headers.get(b"authorization", b"")
        # Constant time: how long a wrong key takes must not tell how much of it was right.
        return hmac.compare_digest(given, b"Bearer " + self.api_key.encode())


class _OpsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so the endpoint runs in this task and sees `_current`."""

    def __init__(self, app, ops: ServerOps):
        self.app, self.ops = app, ops

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ops, path = self.ops, scope["path"]
        headers = dict(scope.get("headers") or [])
        if path.startswith("/v1/") and not ops.authorized(headers):
            status = 401
            body = ops.api_error(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                 type_="invalid_request_error").body()
            body["error"]["code"] = "invalid_api_key"
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            ops.metrics.requests.labels(path, str(status)).inc()
            return
        rec = RequestRecord(route=path)
        if ops.shutting_down and path in GENERATION_ROUTES:
            rec.send = send
            await ops._end(rec, 503, "the server is shutting down")
            return self._finish(rec)
        rec.send = send
        token = _current.set(rec)
        generation = path in GENERATION_ROUTES

        async def observed_send(message):
            async with rec.send_lock:
                if rec.taken_over:      # the middleware already answered: drop the endpoint's bytes
                    return
                if message["type"] == "http.response.start":
                    rec.response_started, rec.status = True, message["status"]
                    ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                    rec.streamed = ctype.startswith(b"text/event-stream")
                elif message["type"] == "http.response.body":
                    if generation:
                        self._observe(rec, message.get("body", b""))
                    rec.response_done = not message.get("more_body", False)
                await send(message)

        try:
            async with anyio.create_task_group() as tg:
                if generation:
                    ops.active.add(rec)
                    if ops.request_timeout:
                        tg.start_soon(self._deadline, rec)
                with anyio.CancelScope() as rec.cancel:
                    await self.app(scope, receive, observed_send)
                tg.cancel_scope.cancel()
        finally:
            ops.active.discard(rec)
            _current.reset(token)
            self._finish(rec)

    async def _deadline(self, rec: RequestRecord) -> None:
        await anyio.sleep(self.ops.request_timeout)
        await self.ops._end(rec, 504, f"the request ran longer than --request-timeout "
                                      f"{self.ops.request_timeout:g}s and was ended")

    def _observe(self, rec: RequestRecord, body: bytes) -> None:
        """Read tokens and timings off the reply as it goes out."""
        now = time.monotonic()
        if not rec.streamed:
            if len(rec.json_body) + len(body) <= MAX_OBSERVED_BODY:
                rec.json_body += body
            return
        rec.sse_buffer += body.decode("utf-8", "replace")
        *events, rec.sse_buffer = rec.sse_buffer.split("\n\n")
        for event in events:
            data = event.removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if "error" in obj:
                rec.error = obj["error"].get("message")
            choice = (obj.get("choices") or [{}])[0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                rec.token_events += 1
                self.ops._generated(1)
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.start
                else:
                    self.ops.metrics.itl.observe(now - rec.last_event)
                rec.last_event = now
            counts = obj.get("usage") or obj.get("metrics")
            if counts:
                self._count(rec, counts)
                # Pieces that held several tokens: the rest of the count arrives with the final chunk.
                self.ops._generated(rec.output_tokens - rec.token_events)
                rec.token_events = max(rec.token_events, rec.output_tokens)

    @staticmethod
    def _count(rec: RequestRecord, counts: dict) -> None:
        rec.prompt_tokens = counts.get("prompt_tokens", counts.get("input_tokens", rec.prompt_tokens))
        rec.output_tokens = counts.get("completion_tokens", counts.get("output_tokens", rec.output_tokens))

    def _finish(self, rec: RequestRecord) -> None:
        ops, total = self.ops, time.monotonic() - rec.start
        if rec.route in GENERATION_ROUTES and not rec.streamed and rec.status == 200 and rec.json_body:
            with_usage = json.loads(rec.json_body) if len(rec.json_body) < MAX_OBSERVED_BODY else {}
            self._count(rec, with_usage.get("usage") or {})
            metrics = with_usage.get("metrics")
            ttfts = [m.get("ttft_ms") for m in (metrics if isinstance(metrics, list) else [metrics or {}])]
            if ttfts and all(isinstance(t, (int, float)) for t in ttfts):
                rec.ttft_s = (rec.queue_s or 0.0) + min(ttfts) / 1000
            ops._generated(rec.output_tokens)
        m = ops.metrics
        m.requests.labels(rec.route, str(rec.status)).inc()
        if rec.route in GENERATION_ROUTES:
            m.prompt_tokens.inc(rec.prompt_tokens)
            m.generation_tokens.inc(rec.output_tokens)
            m.e2e.observe(total)
            if rec.ttft_s is not None:
                m.ttft.observe(rec.ttft_s)
            if rec.status == 200:
                ops._served += 1
        ttft = f"{rec.ttft_s * 1000:.0f}ms" if rec.ttft_s is not None else "-"
        queue = f"{rec.queue_s * 1000:.0f}ms" if rec.queue_s is not None else "-"
        access_log.info("%s %s %d prompt=%d output=%d queue=%s ttft=%s total=%.0fms%s", rec.id, rec.route,
                        rec.status, rec.prompt_tokens, rec.output_tokens, queue, ttft, total * 1000,
                        f" error={rec.error!r}" if rec.error else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $ENGINE_API_KEY)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="requests allowed to wait for the engine; past it: 503 (default: no bound)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="end a request that runs longer than this many seconds (default: never)")
    parser.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds running requests get to finish on SIGTERM/Ctrl-C (default: 10)")


# --8<-- [start:serve]
def serve(app: FastAPI, ops: ServerOps, host: str, port: int) -> None:
    """uvicorn, with our access log instead of its own and a graceful shutdown on SIGTERM."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not ops.shutting_down:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(ops.shutdown()))
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its shutdown (exit code -15); a clean drain exits 0.
            self._captured_signals.clear()

    # uvicorn's own grace is a backstop a little after ours, for anything that ignores cancellation.
    config = uvicorn.Config(app, host=host, port=port, access_log=False,
                            timeout_graceful_shutdown=int(ops.shutdown_grace) + 5)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(Server(config).serve())
    loop.close()
# --8<-- [end:serve]
