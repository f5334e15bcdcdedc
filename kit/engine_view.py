"""kit/engine_view.py - the scheduler as the classroom page draws it: requests, KV blocks, steps.

Chapter 9's engine answers `snapshot()` from its own loop thread, between two steps, so the
queues and block tables it describes hold still while they are read. This module shapes what
it reads into plain, bounded dicts (`describe`), and serves them at GET /engine/scheduler with
one snapshot shared by every browser for SNAPSHOT_TTL_S (`EngineView`): thirty tabs polling
twice a second cost the engine at most four snapshots a second, taken in a worker thread,
never on the event loop, and no poll waits long for one. An engine without a scheduler answers `{"available": false}`.

    curl -s 'http://127.0.0.1:8001/engine/scheduler?since=0' | python -m json.tool
"""

from __future__ import annotations

import asyncio
import time

import anyio
from fastapi import FastAPI, Query

MAX_ROWS = 64            # request rows in one snapshot; past it, "rows_total" says how many there were
MAX_BLOCKS = 4096        # KV blocks drawn; past it, "blocks.shown" < "blocks.total"
FINISHED_KEEP_S = 5.0    # a finished request stays on the page this long
RATE_WINDOW_S = 5.0      # steps/s and tokens/s over the last seconds
SNAPSHOT_TTL_S = 0.25    # one snapshot serves every poll this long
MAX_STEP = 2 ** 53       # the largest `since` accepted (JavaScript's exact integers)


# --8<-- [start:describe]
def request_row(r, state: str, now: float) -> dict:
    """One request as a row of the page: where it stands, its TTFT and its tokens so far."""
    return {"id": r.id, "state": state, "prompt_tokens": r.n_prompt, "tokens": len(r.new_ids),
            "budget": r.budget, "computed": r.num_computed, "total": r.num_tokens,
            "cached_tokens": r.cached_tokens or 0, "preemptions": r.preemptions,
            "ttft_ms": round((r.t_first - r.arrival) * 1000, 1) if r.t_first else None,
            "age_s": round(now - r.arrival, 2), "finish_reason": r.finish_reason}


def running_state(r) -> str:
    """prefill while more than its newest token lacks K/V (chunk by chunk), then decode."""
    return "prefill" if r.num_tokens - r.num_computed > 1 else "decode"


def describe(scheduler, blocks, finished, step_log, num_steps: int, arriving: list, now: float,
             max_rows: int = MAX_ROWS, max_blocks: int = MAX_BLOCKS) -> dict:
    """The scheduler's queues as rows (running, then waiting, then recently finished), the pool as
    one owner and one reference count per block, and the recent steps. `arriving`: requests handed
    to the engine that the scheduler takes at its next step. Read only: the caller makes sure
    nothing changes meanwhile (the engine loop answers between two steps)."""
    rows = [request_row(r, running_state(r), now) for r in scheduler.running]
    rows += [request_row(r, "preempted" if r.preemptions else "waiting", now)
             for r in [*scheduler.waiting, *arriving]]
    rows += [{**row, "ago_s": round(now - t, 2)} for t, row in reversed(finished) if now - t <= FINISHED_KEEP_S]
    shown = min(blocks.num_blocks, max_blocks)
    owner = [-1] * shown
    for seq, table in blocks.tables.items():       # oldest sequence first: a shared block shows its first owner
        for b in table:
            if b < shown and owner[b] < 0:
                owner[b] = seq
    cached = getattr(blocks, "content", {}) if blocks.caches_prefixes else {}
    recent = [s for s in step_log if now - s[1] <= RATE_WINDOW_S]
    return {
        "available": True, "step": num_steps, "waiting": len(scheduler.waiting) + len(arriving),
        "running": len(scheduler.running), "preemptions": scheduler.num_preemptions,
        "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "rows": rows[:max_rows], "rows_total": len(rows),
        "blocks": {"total": blocks.num_blocks, "shown": shown, "block_size": blocks.block_size,
                   "free": blocks.num_free, "prefix_caching": blocks.caches_prefixes,
                   "owner": owner, "refs": blocks.ref_counts[:shown],
                   "cached": [1 if b in cached else 0 for b in range(shown)] if cached else []},
        "steps": [[n, batch, tokens] for n, _, batch, tokens in step_log],   # [step, batch size, new tokens]
        "steps_per_s": round(len(recent) / RATE_WINDOW_S, 2),
        "tokens_per_s": round(sum(s[3] for s in recent) / RATE_WINDOW_S, 2),
        "window_s": RATE_WINDOW_S}
# --8<-- [end:describe]


# --8<-- [start:view]
class EngineView:
    """GET /engine/scheduler: one snapshot shared by every poll for ttl_s, taken in a worker thread."""

    def __init__(self, engine, ttl_s: float = SNAPSHOT_TTL_S):
        self.engine, self.ttl_s = engine, ttl_s
        self._snap, self._at, self._refresh = None, float("-inf"), None

    async def get(self, since: int = -1) -> dict:
        """The shared snapshot, with only the steps after `since` (the page asks for what it lacks)."""
        snap = await self._fresh()
        if "steps" in snap:
            snap = {**snap, "steps": [s for s in snap["steps"] if s[0] > since]}
        return snap

    async def _fresh(self) -> dict:
        """Past ttl_s, one refresh starts, and every poll meanwhile waits for it at most ttl_s
        before taking the last snapshot: a long step delays the picture, never the poll."""
        if time.monotonic() - self._at >= self.ttl_s and self._refresh is None:
            self._refresh = asyncio.ensure_future(self._take_in_thread())
        if self._refresh is not None:
            await asyncio.wait({self._refresh}, timeout=None if self._snap is None else self.ttl_s)
        return self._snap

    async def _take_in_thread(self) -> None:
        try:
            snap = await anyio.to_thread.run_sync(self._take)
            self._snap = snap or self._snap or {"available": None, "note": "the engine is busy: no snapshot yet"}
            self._at = time.monotonic()
        finally:
            self._refresh = None

    def _take(self) -> dict | None:
        snapshot = getattr(self.engine, "snapshot", None)
        if not callable(snapshot):                 # Chapter 1's engines: no scheduler to show
            return {"available": False, "engine": type(self.engine).__name__}
        return snapshot()                          # None: no answer in time, keep the last one
# --8<-- [end:view]


def install(app: FastAPI, engine) -> EngineView:
    """Add GET /engine/scheduler?since=STEP to the app."""
    view = EngineView(engine)

    @app.get("/engine/scheduler")
    async def engine_scheduler(since: int = Query(-1, ge=-1, le=MAX_STEP)):
        return await view.get(since)
    return view
