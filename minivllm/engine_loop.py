"""Chapter 9: the engine loop. Live traffic: submit, read a stream, abort.

`submit()` hands a request to a background thread that steps the scheduler while there is work;
the caller reads text pieces, then the GenerateResult, from the request's own queue, and
`abort()` frees its blocks at the next step (so does dropping the stream unread). `close()` ends
the loop. `generate` and `generate_batch` are submit and read, so one code path serves the
offline interface and the server alike.

The loop needs from its engine only `step()`, `new_request()`, `_leave()`, `_describe()`, its
`scheduler`, `blocks` and `output`: engine.py is the engine, this is how it is driven.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator

from minivllm import threads as cpu_threads
from minivllm.contracts import GenerateResult, SamplingParams, TextPiece, check_prompts
from minivllm.output import Request


# Engines whose loop has run: closed at interpreter exit, so that a script that never called close()
# (or was stopped by Ctrl-C) ends without a loop thread inside torch while the process is torn down
# (an abort, exit 134, and a core file) and without a worker process left behind.
_STARTED: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(engine) -> None:
    """engine.close() runs at interpreter exit, unless the engine is gone by then."""
    _STARTED.add(engine)


EXIT_JOIN_S = 10.0   # how long interpreter exit waits for a loop thread to finish its step


@atexit.register
def _close_started() -> None:
    stuck = False
    for engine in list(_STARTED):
        try:
            if isinstance(engine, EngineLoop) and not engine.stop_loop(EXIT_JOIN_S):
                stuck = True           # close() would wait for it forever: close only what it started
                runner = getattr(engine, "runner", None)
                if runner is not None:
                    runner.close()
                continue
            engine.close()
        except Exception:   # noqa: BLE001 - at exit, one engine's failure must not keep the others open
            pass
    if stuck:   # a step that never returns must not keep the process alive: its workers are closed above
        interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
        sys.stderr.write(f"[engine] the engine loop did not stop within {EXIT_JOIN_S:.0f} s; exiting without it\n")
        sys.stderr.flush()
        os._exit(130 if interrupted else 1)


def indexed(piece: str, index: int) -> TextPiece:
    """A streamed piece that says which answer it belongs to (Chapter 16: n answers, one stream)."""
    return TextPiece(piece, getattr(piece, "logprobs", ()), index)


class EngineUnavailable(RuntimeError):
    """The engine can serve nothing more (a tensor-parallel worker died): a server answers 503."""


class EngineLoop:
    """The thread that steps an engine while it has work, and the requests' way in and out."""

    def __init__(self):
        self._cv, self._inbox, self._aborts, self._closing = threading.Condition(), [], set(), False
        self._idle, self._snapshots = False, []   # snapshot(): answered by the loop between two steps
        self._thread: threading.Thread | None = None
        self._by_id: dict[int, Request] = {}
        self.num_aborted = 0   # requests stopped before they finished (a client that left, a cancel)
        self.broken: EngineUnavailable | None = None   # set by fail(): nothing more is served
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()   # ids of requests whose stream was dropped unread

    # --8<-- [start:loop]
    def submit(self, prompt: str, max_new_tokens: int, params: SamplingParams | None = None) -> RequestStream:
        """Queue one request for the engine loop; iterate the answer: text pieces, then the
        GenerateResult. Closing the iterator early aborts the request."""
        return self.submit_all([self.new_request(prompt, max_new_tokens, params)])[0]

    def submit_all(self, requests: list[Request]) -> list[RequestStream]:
        """Hand requests built by new_request (all checked already) to the loop in one go:
        they join the same step."""
        self._hand_over(requests)
        return [RequestStream(self, r) for r in requests]

    def fail(self, reason: str) -> None:
        """The engine cannot go on (called from any thread): every request in flight or waiting ends
        with this error, and every later one is refused with it, until the process ends."""
        with self._cv:
            self.broken = EngineUnavailable(reason)
            self._cv.notify()

    def unavailable(self) -> str | None:
        return None if self.broken is None else str(self.broken)

    def _hand_over(self, requests: list[Request]) -> None:
        """Give requests to the engine loop (starting it on first use) in one go: they join the same step."""
        if self.broken:
            raise self.broken
        for r in requests:
            r.sink = queue.SimpleQueue()
            for m in r.group or ():   # Chapter 16: every answer to one prompt goes to the one reader
                m.sink = r.sink
        cpu_threads.release_idle_workers()   # the loop thread computes; this thread's idle CPU workers go
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
                self._thread.start()
                close_at_exit(self)
            self._inbox.extend(requests)
            self._cv.notify()

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step, waiting or running; its blocks are freed."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def _has_work(self) -> bool:
        """Anything for the loop to do (called under self._cv)."""
        return bool(self._inbox or self._aborts or self._closing or self.broken or self.scheduler.has_work())

    def _loop(self) -> None:
        """The engine loop: take new requests and aborts, step while there is work, sleep when idle."""
        while True:
            with self._cv:
                self._answer_snapshots()          # between two steps: queues and blocks hold still
                if not self._has_work():
                    cpu_threads.release_idle_workers()   # idle: whoever computes next has the cores alone
                self._idle = True                 # while it waits, snapshot() may read the state itself
                while not self._has_work():
                    self._cv.wait()
                self._idle = False
                if self._closing or self.broken:  # under the lock: no new loop starts meanwhile
                    closed = self.broken or RuntimeError("the engine was closed")
                    for r in self._inbox:
                        r.sink.put(("error", closed))
                    self._fail_in_flight(closed, everyone=True)
                    self._inbox, self._aborts, self._closing, self._thread = [], set(), False, None
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            while not self._dropped.empty():
                aborts.add(self._dropped.get_nowait())
            for r in inbox:
                members = r.group or [r]           # Chapter 16: the answers to one prompt enter together
                try:
                    for m in members:
                        self.runner.admit(m)       # what the runner holds for it from here (an adapter)
                    self.scheduler.add(r)
                    self._by_id.update((m.id, m) for m in members)
                except ValueError as exc:
                    for m in members:
                        self.runner.release(m)
                    r.sink.put(("error", exc))
            for rid in aborts:
                if rid in self._by_id:
                    r = self._by_id.pop(rid)
                    for m in r.group or [r]:       # an abort stops every answer to the prompt
                        self._by_id.pop(m.id, None)
                        if m.finish_reason is None:
                            self._leave(m)
                    self.num_aborted += 1
                    r.sink.put(("aborted", None))   # wakes a reader blocked on this request
            if not self.scheduler.has_work():
                continue
            try:
                events = self.step()
                for r, piece in events:
                    if piece:
                        r.sink.put(("piece", piece if r.group is None else indexed(piece, r.choice)))
                for r, _ in events:                        # after every piece of the step (Chapter 16's n)
                    lead = (r.group or [r])[0]             # a group's first answer holds its place to the end
                    if r.finish_reason and r is not lead:
                        self._by_id.pop(r.id, None)
                    if all(m.finish_reason for m in lead.group or [lead]) and self._by_id.pop(lead.id, None):
                        r.sink.put(("done", self.output.result(lead)))
            except Exception as exc:              # fail what was in flight, never the loop itself
                if isinstance(exc, EngineUnavailable):   # and refuse what comes next, if nothing can be served
                    self.fail(str(exc))
                self._fail_in_flight(exc)
    # --8<-- [end:loop]

    def _fail_in_flight(self, exc: Exception, everyone: bool = False) -> None:
        """Every request that was in the failed step, or left it without its reader being told,
        gets the error; requests still waiting hold no KV and keep their place in the queue."""
        waiting = set() if everyone else set(map(id, self.scheduler.waiting))
        for r in [r for r in self._by_id.values() if id((r.group or [r])[0]) not in waiting]:
            if r.finish_reason is None:           # a group's finished first answer has left already
                self._leave(r)
            if r.id in self.blocks.tables:        # a step that failed half-way may leave blocks behind
                self.blocks.free(r.id)
            del self._by_id[r.id]
            r.sink.put(("error", exc))

    def close(self) -> None:
        """Stop the engine loop, so that the engine can be freed; what is in flight fails.
        A later submit starts a new loop."""
        self.stop_loop(None)

    def stop_loop(self, timeout_s: float | None) -> bool:
        """Ask the loop to stop after its step and wait up to timeout_s (None: as long as it takes).
        True once no loop thread runs."""
        with self._cv:
            if self._thread is None:
                return True
            thread, self._closing = self._thread, True
            self._cv.notify()
        if thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    # --8<-- [start:interface]
    def generate_stream(self, prompt: str, max_new_tokens: int,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        yield from self.submit(prompt, max_new_tokens, params)   # closing this closes the stream

    def generate(self, prompt: str, max_new_tokens: int, params: SamplingParams | None = None) -> GenerateResult:
        return self.submit(prompt, max_new_tokens, params).result()

    def generate_batch(self, prompts: list[str], max_new_tokens: int,
                       params: SamplingParams | list[SamplingParams] | None = None,
                       **per_request) -> list[GenerateResult]:
        """Every prompt enters the scheduler at once; each leaves the step it finishes. params: one
        SamplingParams for all, or a list of them, one per prompt (as vLLM's generate takes).
        per_request: more keywords of new_request, each one value for all or a list, one per
        prompt (Chapter 17's lora_request)."""
        check_prompts(prompts)
        each = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"params: {len(each)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        extras = [{} for _ in prompts]
        for name, value in per_request.items():
            values = list(value) if isinstance(value, (list, tuple)) else [value] * len(prompts)
            if len(values) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts need 1 or {len(prompts)} {name}s, got {len(values)}")
            for extra, v in zip(extras, values):
                extra[name] = v
        t0 = time.perf_counter()
        streams = self.submit_all([self.new_request(p, max_new_tokens, sp, arrival=t0, **extra)   # all checked first
                                   for p, sp, extra in zip(prompts, each, extras)])
        try:
            return [s.result() for s in streams]
        finally:              # one failed, or the caller was interrupted: nothing keeps running
            for s in streams:
                s.close()
    # --8<-- [end:interface]

    # --8<-- [start:snapshot]
    def snapshot(self, timeout_s: float = 10.0) -> dict | None:
        """The scheduler's state for the classroom page (kit/engine_view.py): each request's state,
        TTFT and tokens, each KV block's owner and reference count, the recent steps. Plain dicts,
        bounded in size. Read by the engine loop between two steps, or here while the loop sleeps,
        so no step changes what is being read. None if the loop did not answer within timeout_s."""
        with self._cv:
            if self._thread in (None, threading.current_thread()) or self._idle:   # nothing changes them now
                return self._describe()
            answer: list = []
            done = threading.Event()
            self._snapshots.append((done, answer))
            self._cv.notify()
        done.wait(timeout_s)
        return answer[0] if answer else None

    def _answer_snapshots(self) -> None:
        """The loop, between two steps (under self._cv): answer whoever asked for a snapshot."""
        if self._snapshots:
            snap = self._describe()
            for done, answer in self._snapshots:
                answer.append(snap)
                done.set()
            self._snapshots = []
    # --8<-- [end:snapshot]


class RequestStream:
    """One submitted request, read from any thread: text pieces, then its GenerateResult.

    Not a generator on purpose: close() may be called from another thread while a reader
    is blocked waiting for the next piece (the server does this when a client hangs up).
    """

    def __init__(self, engine: EngineLoop, request: Request):
        self.engine, self.request, self.done = engine, request, False
        self.request_id = request.id
        # A reader that drops its stream unread wants no answer: the loop aborts the request. Told by a
        # weakref whose callback is C code (a queue's put), not a __del__: Python code run as a finalizer
        # on the main thread would swallow a Ctrl-C that lands in it (an exception there is "ignored").
        request.dropped = weakref.ref(self, functools.partial(engine._dropped.put, request.id))

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> str | GenerateResult:
        if self.done:
            raise StopIteration
        while True:   # woken now and then: a Ctrl-C the OS handed to the loop thread is raised here promptly
            try:
                kind, value = self.request.sink.get(timeout=0.25)
                break
            except queue.Empty:
                continue
        if kind in ("done", "error", "aborted"):
            self.done = True
        if kind == "error":
            raise value
        if kind == "aborted":
            raise StopIteration
        return value

    def result(self) -> GenerateResult:
        """Read to the end and return the GenerateResult (a failed request raises its error)."""
        items = list(self)
        if not items or not isinstance(items[-1], GenerateResult):
            raise RuntimeError(f"request {self.request_id} was aborted before it finished")
        return items[-1]

    def close(self) -> None:
        """Abort the request unless it already finished: its blocks are freed at the next step."""
        if not self.done and any(m.finish_reason is None for m in self.request.group or [self.request]):
            self.engine.abort(self.request.id)

    cancel = close

