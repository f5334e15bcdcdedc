"""Chapter 9: continuous batching. Requests join and leave every step.

Static batching (Chapter 5) takes a batch, runs it until its longest member is done, and only
then looks at the queue again. This engine looks at the queue before *every* step: the
scheduler fills one ragged batch with each running request's next token and, while the token
budget and the KV pool allow, chunks of new prompts. A request that finishes leaves at once;
its blocks go to the next one in line.

The engine is its parts, each from its own chapter, handed in ready-made:

    output processor  text in, text out, the results (Chapter 2)
    model runner      prepare -> forward -> sample over whatever the scheduler picked (Chapter 6),
                      on a KV pool of blocks (Chapter 7); a tensor-parallel group is a runner too
    block manager     blocks for tokens; one that remembers prefixes is Chapter 8's
    scheduler         who runs this step, over the block manager (13_scheduler.py walks it by hand)

Chapter 10's speculation is a runner too: it proposes guesses before the step and verifies them
in it, behind the same calls, so the step below has no branch for it.

A step reads schedule -> run -> postprocess. `LLM` (llm.py) builds the parts from options;
the loop that serves live traffic (submit, streams, abort) is `engine_loop.py`.
"""

from __future__ import annotations

import collections
import time

from minivllm.contracts import BaseOfflineEngine, SamplingParams, join_pieces
from minivllm.engine_loop import EngineLoop
from minivllm.model_runner import ModelRunner
from minivllm.output import OutputProcessor, Request
from minivllm.scheduler import Scheduler
from minivllm.snapshot import request_row, scheduler_snapshot


class LLMEngine(EngineLoop, BaseOfflineEngine):
    """Chapter 9: a scheduler picks every step's batch from parts built elsewhere."""

    def capabilities(self):
        """It schedules its requests itself, on max_num_seqs seats and a pool of token_capacity
        tokens; it streams and takes a prompt as token ids (minivllm/text.py: tokenize)."""
        return super().capabilities().replace(
            model_name=self.model_name, device=str(self.device), context_length=self.context_length,
            streams=True, accepts_token_ids=True, schedules_itself=True, max_num_seqs=self.max_num_seqs,
            token_capacity=self.token_capacity, vllm_sampling=True, scores_prompts=True,
            parallel_sampling=self.output.forks)

    # --8<-- [start:init]
    def __init__(self, model_name: str, tokenizer, output: OutputProcessor, runner: ModelRunner,
                 scheduler: Scheduler):
        self.model_name, self.tokenizer, self.output = model_name, tokenizer, output
        self.runner, self.scheduler, self.blocks = runner, scheduler, scheduler.blocks
        self.context_length = runner.model.config.max_position_embeddings
        self.device = runner.model.device
        self.on_step = None                  # the demo's tracer: called with each step's record
        self.recent_batches: collections.deque = collections.deque(maxlen=64)
        self.num_steps = 0                   # steps so far: the classroom page polls by step number
        self.step_log: collections.deque = collections.deque(maxlen=256)    # (step, time, batch, new tokens)
        self.finished: collections.deque = collections.deque(maxlen=64)     # (time, row) of recent leavers
        EngineLoop.__init__(self)
    # --8<-- [end:init]

    @property
    def token_capacity(self) -> int:
        """The most tokens one request can ever hold, prompt and answer: the whole KV pool."""
        return self.blocks.num_blocks * self.blocks.block_size

    @property
    def model(self):
        return self.runner.model

    @property
    def pool(self):
        return self.runner.kv

    @property
    def quant(self) -> str | None:
        """The weight format's name (Chapter 12); None: the model's own float weights."""
        return self.model.format_name

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.caches_prefixes

    # --8<-- [start:new-request]
    def new_request(self, prompt: str | list[int], max_new_tokens: int,
                    params: SamplingParams | None = None, arrival: float | None = None) -> Request:
        """Check and tokenise now, in the caller's thread: a bad request never reaches the loop.
        A list of token ids is taken as tokenised already (the server tokenises once)."""
        r = self.output.request_for(prompt, max_new_tokens, params, self.context_length, arrival)
        self.blocks.check_fits(r.n_prompt, r.budget)
        if r.seats > self.max_num_seqs:   # Chapter 16: n answers run as n sequences of one step
            raise ValueError(f"n = {r.seats} sequences for one prompt, but a step runs at most "
                             f"max_num_seqs = {self.max_num_seqs}: lower n (or best_of) or raise max_num_seqs")
        return r
    # --8<-- [end:new-request]

    # --8<-- [start:step]
    def step(self) -> list[tuple[Request, str]]:
        """schedule -> run -> postprocess: one scheduler decision, one step of the model runner,
        one token (or a run of verified guesses) for each request whose known tokens are all
        computed. Returns (request, new text) for those; finished requests have left."""
        work = self.scheduler.schedule()
        if not work.requests:
            return []
        self.runner.propose(work, self.scheduler.max_num_batched_tokens)   # Chapter 10's guesses, if any
        self.scheduler.add_guesses(work)          # ride in this step, from what the budget has left
        self.runner.copy_blocks(self.blocks.take_copies())   # Chapter 16: copy-on-write (most steps: none)
        places = [self.blocks.tables[r.id] for r in work.requests]
        runs = self.runner.run(work.requests, work.starts, work.lengths, places)   # 1 token, or 1 .. k + 1
        events = self.postprocess(work, runs)
        self.runner.settle(work.requests)         # what of the step reached the output
        if self.on_step:
            self.on_step(work, events)
        return events

    def postprocess(self, work, runs: list[list[int] | None]) -> list[tuple[Request, str]]:
        """Each request's new tokens through the output processor; blocks published, trimmed or freed."""
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
                events.append((r, join_pieces(pieces)))
            self.blocks.cache_computed(r.id, r.first_tokens(r.num_computed))   # a prefix cache publishes full blocks
            if r.finish_reason:
                self._leave(r)                    # leaves now: its blocks serve the next step
            elif self.blocks.lengths[r.id] > r.num_tokens:
                self.blocks.truncate(r.id, r.num_tokens)   # slots of rejected guesses go back
        self.recent_batches.append(len(work.requests))
        self.num_steps += 1
        self.step_log.append((self.num_steps, now, len(work.requests), generated))
        return events
    # --8<-- [end:step]

    def _leave(self, r: Request) -> None:
        """r is done or aborted: out of the scheduler, and of the runner's memory (a drafter's)."""
        self.scheduler.finish(r)
        now = time.perf_counter()   # the classroom page shows it a few seconds more
        self.finished.append((now, request_row(r, "finished", now)))
        self.runner.release(r)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM has the same call), e.g. between two measurements."""
        if self.scheduler.has_work():
            raise RuntimeError("cannot reset the prefix cache while requests hold blocks")
        if self.prefix_caching:      # Chapter 7's block manager caches nothing to forget
            self.blocks.reset()

    def features(self) -> dict:
        """What this engine was built with, for the server's page and /metrics."""
        return {"engine": type(self).__name__, "quant": self.model.format_name or "float32",
                "max_num_seqs": self.max_num_seqs, "compile": getattr(self.model, "compiled", False),
                "kv_memory": self.pool.nbytes, "block_size": self.pool.block_size,
                "prefix_caching": self.prefix_caching,
                "max_num_batched_tokens": self.scheduler.max_num_batched_tokens, **self.runner.features()}

    def stats(self) -> dict:
        """Read from other threads (the server's panel) while the loop runs: len() and list() of a
        deque are single operations under CPython's GIL, so each number is one consistent reading."""
        return {"kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free,
                "kv_blocks_free": self.blocks.num_free,
                "waiting": sum(r.seats for r in list(self.scheduler.waiting) + list(self._inbox)),   # n answers: n
                "running": self.scheduler.seats_taken, "preemptions": self.scheduler.num_preemptions,
                "aborted": self.num_aborted,
                "batch_sizes": list(self.recent_batches),
                **({"prefix_cache_hit_rate": round(self.blocks.hit_rate, 4)} if self.prefix_caching else {})}

    def _describe(self) -> dict:
        """The scheduler's state as plain data (under the loop's lock, which also guards the
        requests handed over but not yet scheduled)."""
        return scheduler_snapshot(self.scheduler, self.blocks, list(self.finished), list(self.step_log),
                        self.num_steps, list(self._inbox), time.perf_counter())
