"""GET /engine/scheduler and LLM.snapshot(): what the classroom page draws.

The page polls by step number (`since`), so every step is drawn once; rows and blocks are
bounded; one snapshot serves every poll for a quarter of a second; an engine without a
scheduler answers gracefully.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import load_script
from kit import engine_view
from minivllm import LLM
from minivllm.snapshot import scheduler_snapshot

server = load_script("05_server")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20,
                 max_num_seqs=8, max_num_batched_tokens=32, prefix_caching=True)
    yield engine
    engine.close()


def test_steps_come_once_by_step_number(engine):
    with TestClient(server.make_app(engine)) as client:
        before = client.get("/engine/scheduler").json()["step"]
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 7, "ignore_eos": True})
        time.sleep(engine_view.SNAPSHOT_TTL_S)   # past the shared snapshot's lifetime
        snap = client.get("/engine/scheduler", params={"since": before}).json()
        # One step for the short prompt's prefill (it gives the first token), one per later token.
        assert [s[0] for s in snap["steps"]] == list(range(before + 1, before + 8))
        assert snap["step"] == before + 7 and all(s[1] == 1 and s[2] == 1 for s in snap["steps"])
        assert client.get("/engine/scheduler", params={"since": snap["step"]}).json()["steps"] == []
        assert client.get("/engine/scheduler", params={"since": -5}).status_code == 400
        [row] = [r for r in snap["rows"] if r["state"] == "finished"][:1]   # kept a few seconds
        assert row["tokens"] == 7 and row["finish_reason"] == "length" and row["ttft_ms"] > 0


def test_snapshot_shows_each_state_and_the_blocks_owners(engine):
    """Requests stopped between steps by hand: running ones own blocks, a shared prefix has refcount 2."""
    prefix = list(range(100, 148))                      # three full blocks of 16, shared by both
    reqs = [engine.new_request(prefix + [i + 1, i + 2, i + 3], 20) for i in range(3)]
    seen = []
    engine.on_step = lambda work, events: seen.append(engine.snapshot())   # the loop thread asks itself
    try:
        streams = engine.submit_all(reqs[:1])
        next(iter(streams[0]))                          # the first's prompt is computed and cached
        more = engine.submit_all(reqs[1:])
        for s in streams + more:
            s.result()
    finally:
        engine.on_step = None
    states = {row["state"] for snap in seen for row in snap["rows"]}
    assert {"prefill", "decode", "finished"} <= states
    shared = [snap for snap in seen if any(n > 1 for n in snap["blocks"]["refs"])]
    assert shared, "the shared prompt prefix never showed a block with two owners"
    snap = shared[-1]
    owners = {o for o in snap["blocks"]["owner"] if o >= 0}
    assert owners <= {row["id"] for row in snap["rows"]}
    assert snap["blocks"]["prefix_caching"] and len(snap["blocks"]["cached"]) == snap["blocks"]["shown"]
    idle = engine.snapshot()                            # the loop sleeps: read directly
    assert idle["running"] == 0 and all(o < 0 for o in idle["blocks"]["owner"])
    assert sum(idle["blocks"]["cached"]) >= 3           # cached blocks nobody owns, evictable


def test_snapshot_is_bounded(engine):
    reqs = [engine.new_request([7, 8, 9], 3) for _ in range(5)]
    with engine._cv:                                    # the loop may not be stepping while we read
        finished = [(time.perf_counter(), {"id": r.id}) for r in reqs]
        snap = scheduler_snapshot(engine.scheduler, engine.blocks, finished, [], 0, [],
                                              time.perf_counter(), max_rows=2, max_blocks=3)
    assert len(snap["rows"]) == 2 and snap["rows_total"] == 5
    assert snap["blocks"]["shown"] == 3 and len(snap["blocks"]["owner"]) == 3
    assert snap["blocks"]["total"] == engine.blocks.num_blocks


def test_thirty_polls_share_one_snapshot_and_other_engines_answer(engine, tiny_engine):
    calls = []

    class Counting:
        def snapshot(self):
            calls.append(1)
            return engine.snapshot()

    view = engine_view.EngineView(Counting(), ttl_s=60)

    async def thirty():
        return await asyncio.gather(*(view.get(-1) for _ in range(30)))
    answers = asyncio.run(thirty())
    assert len(calls) == 1 and all(a["available"] for a in answers)
    with TestClient(server.make_app(tiny_engine)) as client:   # Chapter 1's engine: no scheduler
        assert client.get("/engine/scheduler").json() == {"available": False, "engine": type(tiny_engine).__name__}


def test_the_endpoint_answers_while_thirty_streams_run(engine):
    app = server.make_app(engine)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            body = {"prompt": "Tell me a story.", "max_tokens": 120, "ignore_eos": True}   # long enough to be seen
            work = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(30)]
            snaps = []
            while not all(w.done() for w in work):
                snaps.append((await client.get("/engine/scheduler")).json())
                await asyncio.sleep(0.05)
            return snaps, [w.result().status_code for w in work]

    snaps, codes = asyncio.run(scenario())
    assert codes == [200] * 30
    busiest = max(snaps, key=lambda s: s["running"])
    assert busiest["running"] == engine.scheduler.max_num_seqs and busiest["waiting"] > 0
    assert any(row["state"] == "waiting" for row in busiest["rows"])
