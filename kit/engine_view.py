"""kit/engine_view.py - the scheduler as the classroom page draws it: requests, KV blocks, steps.

Chapter 9's engine answers `snapshot()` from its own loop thread, between two steps, so the
queues and block tables it describes hold still while they are read; the engine's package shapes
what it reads into plain, bounded dicts (`minivllm/snapshot.py`), and this module serves them at GET /engine/scheduler with
one snapshot shared by every browser for SNAPSHOT_TTL_S (`EngineView`): thirty tabs polling
twice a second cost the engine at most four snapshots a second, taken in a worker thread,
never on the event loop, and no poll waits long for one. An engine without a scheduler answers
`{"available": false}` (BaseOfflineEngine's own `snapshot()`).

    curl -s 'http://127.0.0.1:8001/engine/scheduler?since=0' | python -m json.tool
"""

from __future__ import annotations

import asyncio
import time

import anyio
from fastapi import FastAPI, Query


SNAPSHOT_TTL_S = 0.25    # one snapshot serves every poll this long
MAX_STEP = 2 ** 53       # the largest `since` accepted (JavaScript's exact integers)


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
        return self.engine.snapshot()              # None: no answer in time, keep the last one
# --8<-- [end:view]


# --8<-- [start:tenant]
OTHERS = -2   # a block owner the page draws as "in use, another tenant's": no request id, no prompt


def tenant_view(snap: dict, tenant: str | None) -> dict:
    """What one tenant's key may see: its own requests' rows, and the pool with every other
    tenant's blocks as OTHERS (how full it is, never whose or how long their prompts are).
    tenant None (the admin or metrics key, or a server without keys): everything."""
    if tenant is None or "rows" not in snap:
        return snap
    rows = [row for row in snap["rows"] if row.get("tenant") == tenant]
    mine = {row["id"] for row in rows}
    blocks = dict(snap["blocks"])
    blocks["owner"] = [o if o < 0 or o in mine else OTHERS for o in blocks["owner"]]
    blocks["cached"] = [c if o in mine else 0 for c, o in zip(blocks["cached"], blocks["owner"])]
    return {**snap, "rows": rows, "rows_total": len(rows), "blocks": blocks}
# --8<-- [end:tenant]


def install(app: FastAPI, engine, viewer=lambda: None) -> EngineView:
    """Add GET /engine/scheduler?since=STEP to the app; viewer() names the caller's tenant (None: all)."""
    view = EngineView(engine)

    @app.get("/engine/scheduler")
    async def engine_scheduler(since: int = Query(-1, ge=-1, le=MAX_STEP)):
        return tenant_view(await view.get(since), viewer())
    return view
