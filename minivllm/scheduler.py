"""Chapter 9: the scheduler that decides, every step, who runs.

A request is a list of tokens (its prompt, then what it generated) and one number:
how many of those tokens already have keys and values in the KV pool (`num_computed`).
Every step each scheduled request feeds the model its next uncomputed tokens:

    a new request       its prompt, in chunks of at most the step's token budget
    a running request   its one newest token (a decode step)
    a preempted one     everything again, prompt and generated tokens: recompute

When the last known token has been fed, that forward's logits give the next token.
Prefill and decode are the same operation on different lengths, so one ragged batch
can carry both. The scheduler is bookkeeping only: no tensors, no model.

`13_scheduler.py` runs it on made-up requests and prints every decision.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from minivllm.block_manager import BlockManager
from minivllm.config import check_budgets
from minivllm.kv_cache import PoolFullError
from minivllm.output import Request


@dataclass
class ScheduledBatch:
    """One step's work: request i feeds tokens [starts[i], starts[i] + lengths[i])."""
    requests: list[Request]
    starts: list[int]
    lengths: list[int]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def add(self, r: Request, start: int, n: int) -> None:
        self.requests.append(r)
        self.starts.append(start)
        self.lengths.append(n)


def tenant_of(r: Request) -> str | None:
    """Whose request this is: the part of its cache_salt before the first '/' (None: nobody's)."""
    salt = r.params.cache_salt
    return None if salt is None else salt.split("/", 1)[0]


class Scheduler:
    """Waiting and running queues over a BlockManager, under a token budget and a sequence cap."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 256,
                 max_adapters: int | None = None):
        check_budgets(max_num_seqs, max_num_batched_tokens)   # the options' own rows (minivllm/config.py)
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []            # in admission order: the newest is last
        self.num_preemptions = 0
        self.max_adapters = max_adapters            # Chapter 17: distinct LoRA adapters running at once

    def add(self, request: Request) -> None:
        if self.blocks.blocks_for(request.n_prompt + request.budget) > self.blocks.num_blocks:
            raise ValueError(f"request {request.id} could never fit in the KV pool of "
                             f"{self.blocks.num_blocks} blocks")
        if request.seats > self.max_num_seqs:
            raise ValueError(f"a request of {request.seats} sequences can never run: a step holds at most "
                             f"max_num_seqs = {self.max_num_seqs}")
        self.waiting.append(request)

    @property
    def seats_taken(self) -> int:
        """Sequences running, and those their parents will fork (Chapter 16): each will need a seat."""
        return sum(r.seats for r in self.running)

    def adapter_fits(self, r: Request) -> bool:
        """Chapter 17: r may run beside the running requests' adapters (max_loras device slots)."""
        if self.max_adapters is None or r.adapter is None:
            return True
        held = {q.adapter.key for q in self.running if q.adapter is not None}
        return r.adapter.key in held or len(held) < self.max_adapters

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --8<-- [start:schedule]
    def schedule(self) -> ScheduledBatch:
        """Decodes of running requests first, then prefill chunks, then new admissions; the guesses
        to verify (Chapter 10, `add_guesses`) come after, from what the budget has left."""
        out = ScheduledBatch([], [], [], [])
        for r in [r for r in self.running if r.siblings and r.num_computed == r.num_tokens - 1]:
            self.fork(r)                      # Chapter 16: its prompt is in, but for the last token
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for r in decoding + prefilling:
            budget = self.max_num_batched_tokens - out.num_tokens   # a preemption may give some back
            if budget == 0:
                break
            if r not in self.running:         # preempted a moment ago to make room for an older one
                continue
            n = min(r.num_tokens - r.num_computed - (1 if r.siblings else 0), budget)   # 1 for a decode; a chunk
            if n == 0:
                continue                      # a parent whose siblings fork next step
            if not self._make_room(r, r.num_computed + n, out):
                continue                      # it was the newest, so it preempted itself
            out.add(r, r.num_computed, n)
        budget = self.max_num_batched_tokens - out.num_tokens
        # Admit in arrival order (preempted ones sit at the front), each tenant's turn fairly, while
        # blocks, budget and the cap allow; blocks a prefix cache already holds cost nothing new (Chapter 8).
        # A request of n answers takes n seats (Chapter 16).
        while (self.waiting and budget > 0 and not out.preempted
               and self.seats_taken + (r := self.next_waiting()).seats <= self.max_num_seqs
               and self.blocks.can_allocate_prompt(r.tokens(0, r.num_tokens), r.cache_salt)
               and self.adapter_fits(r)):
            self.waiting.remove(r)
            r.num_computed = self.admit(r)       # 0, or what a prefix cache already holds (Chapter 8)
            r.admitted = r.admitted or time.perf_counter()
            self.running.append(r)
            n = min(r.num_tokens - r.num_computed - (1 if r.siblings else 0), budget)
            if n:                                # (0: a parent with all but its last token cached forks next)
                out.add(r, r.num_computed, n)
            budget -= n
        return out
    # --8<-- [end:schedule]

    # --8<-- [start:fair]
    def next_waiting(self) -> Request:
        """The request to admit next: the oldest waiting one of the tenant with the fewest running.
        A tenant is a cache_salt's first part (the server's API key, "key-2/..."); with one tenant,
        as offline, this is the queue's head. So a tenant that sends 16 requests at once gets its
        share of the seats, and another tenant's one request takes the next free seat."""
        running = collections.Counter(tenant_of(r) for r in self.running)
        return min(self.waiting, key=lambda r: running[tenant_of(r)])   # min keeps the first of equals
    # --8<-- [end:fair]

    # --8<-- [start:guesses]
    def add_guesses(self, out: ScheduledBatch) -> None:
        """Chapter 10: the guesses a speculator hung on decoding requests (`draft_ids`) ride in the
        same step, after everyone's token: from what the budget has left, and from free slots. A
        short budget or a full pool cuts guesses; nobody is preempted or left out for one."""
        budget = self.max_num_batched_tokens - out.num_tokens
        for i, r in enumerate(out.requests):
            if not r.draft_ids:
                continue
            del r.draft_ids[budget:]
            try:
                while self.blocks.lengths[r.id] < r.num_tokens + len(r.draft_ids):
                    self.blocks.append_slot(r.id)
            except PoolFullError:
                del r.draft_ids[self.blocks.lengths[r.id] - r.num_tokens:]
            out.lengths[i] += len(r.draft_ids)
            budget -= len(r.draft_ids)
    # --8<-- [end:guesses]

    # --8<-- [start:admit]
    def admit(self, r: Request) -> int:
        """Blocks for all of r's known tokens; returns how many of them already have their K/V.
        Chapter 7's block manager has none to offer; Chapter 8's prefix cache shares a cached prefix
        (a preempted request re-matches what it computed before, if it is still cached)."""
        cached = self.blocks.allocate_prompt(r.id, r.tokens(0, r.num_tokens), r.cache_salt)
        if r.admitted is None and self.blocks.caches_prefixes:
            r.cached_tokens = cached
        return cached
    # --8<-- [end:admit]

    # --8<-- [start:fork]
    def fork(self, r: Request) -> None:
        """Chapter 16: r's prompt has its K/V but for the last token; each sibling becomes a running
        sequence on r's blocks (reference counts, no copy) and computes that last token itself, its
        first write into the shared last block copying it (copy-on-write), so each draws its own first
        token from the same logits with its own noise."""
        for c in r.siblings:
            self.blocks.fork(r.id, c.id)
            c.num_computed, c.admitted, c.cached_tokens = r.num_computed, r.admitted, r.cached_tokens
            self.running.append(c)
        r.siblings = []
    # --8<-- [end:fork]

    # --8<-- [start:preempt]
    def _make_room(self, r: Request, needed: int, out: ScheduledBatch) -> bool:
        """Slots for r's first `needed` tokens, each block it writes its own (a forked sequence's
        shared last block is copied, Chapter 16); if the pool is full, preempt the newest running
        request (possibly r itself: then False). Preempted work is recomputed later, never lost."""
        while True:
            try:
                while self.blocks.lengths[r.id] < needed:
                    self.blocks.append_slot(r.id)
                self.blocks.own(r.id, r.num_computed, needed)
                return True
            except PoolFullError:
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim in out.requests:    # already scheduled this step: take it out again
                    i = out.requests.index(victim)
                    del out.requests[i], out.starts[i], out.lengths[i]
                if victim is r:
                    return False

    def preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.blocks.free(r.id)
        r.num_computed, r.preemptions, r.draft_ids = 0, r.preemptions + 1, []
        self.num_preemptions += 1
        self.waiting.appendleft(r)
    # --8<-- [end:preempt]

    def finish(self, r: Request) -> None:
        """r is done (or aborted): it leaves at once and its blocks serve the next step."""
        if r in self.running:
            self.running.remove(r)
            self.blocks.free(r.id)
        elif r in self.waiting:
            self.waiting.remove(r)
