"""13_continuous_batching_engine.py - Chapter 9: continuous batching. Requests join and leave every step.

Static batching (Chapter 5) takes a batch, runs it until its longest member is done,
and only then looks at the queue again. A continuous-batching engine looks at the
queue before *every* step: the scheduler (13_scheduler.py) fills one ragged batch with
each running request's next token and, while the token budget and the KV pool allow,
chunks of new prompts. A request that finishes leaves at once; its blocks go to the
next one in line.

This is the book's engine assembled. Every part comes from its own chapter and is composed,
not rewritten: the output processor (Chapter 2), the model runner (Chapter 6: one step is
prepare -> forward -> sample over whatever the scheduler picked), the KV pool and block
manager (Chapter 7), the prefix cache (Chapter 8), the scheduler (13_scheduler.py), and
weights in any format (Chapter 12). Each feature is a keyword of the constructor, with the
same name as the flag of 05_server.py and of both benchmarks:

    quant, group_size, quant_head   weight format: None (float32), "bf16", "int8", "int4"
    prefix_caching                  share the K/V blocks of prompt prefixes seen before
    kv_memory, block_size           the KV pool: bytes, and tokens per block
    max_num_seqs                    sequences in one step, at most
    max_num_batched_tokens          tokens in one step, at most (the prefill chunk size)
    speculative, num_speculative_tokens, draft_model
                                    guess tokens and verify them in one step (Chapter 10)
    tensor_parallel_size            the model split over N processes (Chapter 14)
    compile                         packed weights, fused ops, paged attention (Chapter 13)

    python 13_continuous_batching_engine.py --quant int8 --prefix-caching   # one prompt, as 04_engine.py
    python 13_continuous_batching_demo.py                # a mixed workload, traced step by step
    python 05_server.py --engine 13_continuous_batching_engine:ContinuousBatchingEngine --quant int8 --prefix-caching

For live traffic `submit()` hands a request to a background thread that steps the
scheduler while there is work; the caller reads text pieces, then the GenerateResult,
from the request's own queue, and `abort()` frees its blocks at the next step
(so does dropping the stream unread). `close()` ends the loop.
"""

from __future__ import annotations

import collections
import importlib
import queue
import threading
import time
from collections.abc import Iterator

import torch

from kit import engine_view, plugins
from kit import threads as cpu_threads

engine04 = importlib.import_module("04_engine")
paged = importlib.import_module("11_paged_kv")
engine11 = importlib.import_module("11_paged_kv_engine")
prefix12 = importlib.import_module("12_prefix_cache")
scheduler13 = importlib.import_module("13_scheduler")
SamplingParams, GenerateResult = engine04.SamplingParams, engine04.GenerateResult
Request = scheduler13.Request


class ContinuousBatchingEngine(engine11.PagedEngine):
    """Chapter 9: a scheduler picks every step's batch; every earlier chapter's feature is a switch."""

    # --8<-- [start:init]
    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32, kv_memory: int = paged.DEFAULT_KV_MEMORY,
                 block_size: int = paged.DEFAULT_BLOCK_SIZE, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 256, prefix_caching: bool = False,
                 quant: str | None = None, group_size: int = 32, quant_head: str = "auto",
                 speculative: str | None = None, num_speculative_tokens: int = 4, draft_model: str | None = None,
                 tensor_parallel_size: int = 1, compile: bool = False):
        scheduler13.Scheduler.check_limits(max_num_seqs, max_num_batched_tokens)   # before loading a model
        speculator = plugins.plugin("speculator")(speculative, num_speculative_tokens, draft_model) \
            if speculative is not None else None        # Chapter 10's, found by name (checked now)
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        if prefix_caching:   # Chapter 8: admission shares a cached prefix; each step publishes full blocks
            self.block_manager = prefix12.PrefixCachingBlockManager
        parallel = None
        if compile and tensor_parallel_size != 1:
            raise ValueError("compile=True runs on one process; it is not combined with tensor_parallel_size > 1")
        if tensor_parallel_size != 1:   # Chapter 14, found by name: checked before the model loads
            parallel = plugins.plugin("tensor_parallel")(model_name, tensor_parallel_size, device, quant)
        # Chapters 6, 7 and 12: tokenizer, output processor, model runner on a KV pool, block manager
        super().__init__(model_name, device, dtype, max_num_seqs, kv_memory, block_size, quant, group_size, quant_head,
                         compile)
        if parallel:
            parallel(self)              # the runner becomes rank 0 of tensor_parallel_size processes
        self.scheduler = scheduler13.Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        self.speculator = speculator(self) if speculator else None
        self.on_step = None                  # the demo's tracer: called with each step's record
        self.recent_batches: collections.deque = collections.deque(maxlen=64)
        self.num_steps = 0                   # steps so far: the classroom page polls by step number
        self.step_log: collections.deque = collections.deque(maxlen=256)    # (step, time, batch, new tokens)
        self.finished: collections.deque = collections.deque(maxlen=64)     # (time, row) of recent leavers
        self._cv, self._inbox, self._aborts, self._closing = threading.Condition(), [], set(), False
        self._idle, self._snapshots = False, []   # snapshot(): answered by the loop between two steps
        self._thread: threading.Thread | None = None
        self._by_id: dict[int, Request] = {}
    # --8<-- [end:init]

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.caches_prefixes

    def features(self) -> dict:
        spec = {"speculative": self.speculator.name, "num_speculative_tokens": self.speculator.k} \
            if self.speculator else {}
        return {**super().features(), "max_num_batched_tokens": self.scheduler.max_num_batched_tokens, **spec}

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM has the same call), e.g. between two measurements."""
        if self.scheduler.has_work():
            raise RuntimeError("cannot reset the prefix cache while requests hold blocks")
        if self.prefix_caching:      # Chapter 7's block manager caches nothing to forget
            self.blocks.reset()

    # --8<-- [start:step]
    def step(self) -> list[tuple[Request, str]]:
        """One scheduler decision, one step of the model runner, one token for each request whose
        known tokens are all computed. Returns (request, new text) for those; finished requests
        have left the scheduler."""
        if self.speculator:                       # Chapter 10: guesses join the decodes' tokens
            self.speculator.propose(self.scheduler.running)
        work = self.scheduler.schedule()
        if not work.requests:
            return []
        places = [self.blocks.tables[r.id] for r in work.requests]
        if self.speculator:                       # the tokens each request keeps: 1 .. k + 1
            runs = self.speculator.step(self.runner, work.requests, work.starts, work.lengths, places)
        else:
            runs = [None if t is None else [t] for t in self.runner.step(work.requests, work.starts,
                                                                         work.lengths, places)]
        now, events, generated = time.perf_counter(), [], 0
        for r, n, run in zip(work.requests, work.lengths, runs):
            if run is None:                       # a prefill's middle chunk predicts nothing yet
                r.num_computed += n
            else:
                pieces = []
                for token in run:
                    pieces.append(self.output.accept(r, token, now))
                    if r.finish_reason:           # a stop, EOS or the budget can cut a run short
                        break
                r.num_computed = r.num_tokens - 1     # every token but the newest has its K/V now
                generated += len(pieces)
                events.append((r, engine04.contracts.join_pieces(pieces)))
            self.blocks.cache_computed(r.id, r.tokens(0, r.num_computed))   # a prefix cache publishes full blocks
            if r.finish_reason:
                self._leave(r)                    # leaves now: its blocks serve the next step
            elif self.blocks.lengths[r.id] > r.num_tokens:
                self.blocks.truncate(r.id, r.num_tokens)   # slots of rejected guesses go back
        self.recent_batches.append(len(work.requests))
        self.num_steps += 1
        self.step_log.append((self.num_steps, now, len(work.requests), generated))
        if self.on_step:
            self.on_step(work, events)
        return events
    # --8<-- [end:step]

    def _leave(self, r: Request) -> None:
        """r is done or aborted: out of the scheduler, and of the drafter's memory."""
        self.scheduler.finish(r)
        now = time.perf_counter()   # the classroom page shows it a few seconds more
        self.finished.append((now, engine_view.request_row(r, "finished", now)))
        if self.speculator:
            self.speculator.release(r)

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

    def _hand_over(self, requests: list[Request]) -> None:
        """Give requests to the engine loop (starting it on first use) in one go: they join the same step."""
        for r in requests:
            r.sink = queue.SimpleQueue()
        cpu_threads.release_idle_workers()   # the loop thread computes; this thread's idle CPU workers go
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
                self._thread.start()
            self._inbox.extend(requests)
            self._cv.notify()

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step, waiting or running; its blocks are freed."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def _has_work(self) -> bool:
        """Anything for the loop to do (called under self._cv)."""
        return bool(self._inbox or self._aborts or self._closing or self.scheduler.has_work())

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
                if self._closing:                 # under the lock: no new loop starts meanwhile
                    closed = RuntimeError("the engine was closed")
                    for r in self._inbox:
                        r.sink.put(("error", closed))
                    self._fail_in_flight(closed, everyone=True)
                    self._inbox, self._aborts, self._closing, self._thread = [], set(), False, None
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for r in inbox:
                try:
                    self.scheduler.add(r)
                    self._by_id[r.id] = r
                except ValueError as exc:
                    r.sink.put(("error", exc))
            for rid in aborts:
                if rid in self._by_id:
                    r = self._by_id.pop(rid)
                    self._leave(r)
                    r.sink.put(("aborted", None))   # wakes a reader blocked on this request
            if not self.scheduler.has_work():
                continue
            try:
                for r, piece in self.step():
                    if piece:
                        r.sink.put(("piece", piece))
                    if r.finish_reason:
                        self._by_id.pop(r.id, None)
                        r.sink.put(("done", self.output.result(r)))
            except Exception as exc:              # fail what was in flight, never the loop itself
                self._fail_in_flight(exc)
    # --8<-- [end:loop]

    def _fail_in_flight(self, exc: Exception, everyone: bool = False) -> None:
        """Every request that was in the failed step, or left it without its reader being told,
        gets the error; requests still waiting hold no KV and keep their place in the queue."""
        waiting = set() if everyone else set(map(id, self.scheduler.waiting))
        for r in [r for r in self._by_id.values() if id(r) not in waiting]:
            self._leave(r)
            if r.id in self.blocks.tables:        # a step that failed half-way may leave blocks behind
                self.blocks.free(r.id)
            del self._by_id[r.id]
            r.sink.put(("error", exc))

    def close(self) -> None:
        """Stop the engine loop, so that the engine can be freed; what is in flight fails.
        A later submit starts a new loop."""
        with self._cv:
            if self._thread is None:
                return
            thread, self._closing = self._thread, True
            self._cv.notify()
        if thread is not threading.current_thread():
            thread.join()

    # --8<-- [start:interface]
    def generate_stream(self, prompt: str, max_new_tokens: int,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        yield from self.submit(prompt, max_new_tokens, params)   # closing this closes the stream

    def generate(self, prompt: str, max_new_tokens: int, params: SamplingParams | None = None) -> GenerateResult:
        return self.submit(prompt, max_new_tokens, params).result()

    def generate_batch(self, prompts: list[str], max_new_tokens: int,
                       params: SamplingParams | None = None) -> list[GenerateResult]:
        """Every prompt enters the scheduler at once; each leaves the step it finishes."""
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings")
        t0 = time.perf_counter()
        streams = self.submit_all([self.new_request(p, max_new_tokens, params, arrival=t0)   # all checked first
                                   for p in prompts])
        try:
            return [s.result() for s in streams]
        finally:              # one failed, or the caller was interrupted: nothing keeps running
            for s in streams:
                s.close()
    # --8<-- [end:interface]

    def stats(self) -> dict:
        """Read from other threads (the server's panel) while the loop runs: len() and list() of a
        deque are single operations under CPython's GIL, so each number is one consistent reading."""
        return {**super().stats(), "waiting": len(self.scheduler.waiting) + len(self._inbox),
                "running": len(self.scheduler.running), "preemptions": self.scheduler.num_preemptions,
                "batch_sizes": list(self.recent_batches),
                **({"prefix_cache_hit_rate": round(self.blocks.hit_rate, 4)} if self.prefix_caching else {})}


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

    def _describe(self) -> dict:
        """(under self._cv, which also guards the requests handed over but not yet scheduled)"""
        return engine_view.describe(self.scheduler, self.blocks, list(self.finished), list(self.step_log),
                                    self.num_steps, list(self._inbox), time.perf_counter())
    # --8<-- [end:snapshot]


class RequestStream:
    """One submitted request, read from any thread: text pieces, then its GenerateResult.

    Not a generator on purpose: close() may be called from another thread while a reader
    is blocked waiting for the next piece (the server does this when a client hangs up).
    """

    def __init__(self, engine: ContinuousBatchingEngine, request: Request):
        self.engine, self.request, self.done = engine, request, False
        self.request_id = request.id

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> str | GenerateResult:
        if self.done:
            raise StopIteration
        kind, value = self.request.sink.get()
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
        if not self.done and self.request.finish_reason is None:
            self.engine.abort(self.request.id)

    cancel = close

    def __del__(self) -> None:
        """A reader that drops its stream unread wants no answer: stop the work, free the blocks."""
        try:
            self.close()
        except Exception:   # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass


def main() -> None:
    engine, _, _ = engine04.engine_main(ContinuousBatchingEngine, "Chapter 9: the assembled engine, every feature a switch.")
    print(f"  {'features':<15} {engine.features()}")
    engine.close()


if __name__ == "__main__":
    main()
