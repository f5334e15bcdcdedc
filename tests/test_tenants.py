"""Tenants on one server: each API key sees its own requests only, and gets its share of the seats."""

from __future__ import annotations

import asyncio
import importlib
import time

import httpx

from conftest import load_script
from kit import engine_view
from minivllm import LLM

server = load_script("05_server")
server_ops = importlib.import_module("kit.server_ops")
ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_of_sixteen_requests_holds_anothers_one_behind_at_most_half_and_sees_only_its_own(tiny_model_dir):
    """--max-num-seqs 4: alice sends 16 requests at once, then bob one. Bob's answer comes back
    before more than half of alice's (the fair scheduler gives him the next free seat; first come,
    first served would make him the seventeenth). Meanwhile each key's /engine/scheduler shows its
    own rows only and the pool without the other's request ids; /metrics takes the admin key only."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, max_num_seqs=4, max_num_batched_tokens=64)
    app = server.make_app(engine, ops=server_ops.ServerOps(api_key=(ALICE, BOB), admin_key=ADMIN))
    body = {"prompt": "Count to ten.", "max_tokens": 12, "ignore_eos": True}
    order: list[str] = []

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            async def send(key: str, name: str):
                r = await client.post("/v1/completions", json=body, headers=bearer(key))
                assert r.status_code == 200, r.text
                order.append(name)

            alice = [asyncio.create_task(send(ALICE, "alice")) for _ in range(16)]
            deadline = time.monotonic() + 30
            while engine.stats()["waiting"] + engine.stats()["running"] < 16:   # all sixteen are the engine's
                assert time.monotonic() < deadline, engine.stats()
                await asyncio.sleep(0.005)
            bob = asyncio.create_task(send(BOB, "bob"))
            while engine.stats()["waiting"] + engine.stats()["running"] < 17 and not bob.done():
                await asyncio.sleep(0.005)
            views = {key: (await client.get("/engine/scheduler", headers=bearer(key))).json()
                     for key in (ADMIN, ALICE, BOB)}
            metrics = {key: (await client.get("/metrics", headers=bearer(key))).status_code
                       for key in (ADMIN, ALICE, BOB)}
            await asyncio.gather(*alice, bob)
            return views, metrics

    try:
        views, metrics = asyncio.run(scenario())
    finally:
        engine.close()
    assert order.index("bob") <= 8, order          # at most 8 of alice's 16 answered before bob's one
    assert metrics == {ADMIN: 200, ALICE: 401, BOB: 401}
    everyone = views[ADMIN]
    assert {row["tenant"] for row in everyone["rows"]} == {"key-0", "key-1"}
    for key, tenant in ((ALICE, "key-0"), (BOB, "key-1")):
        mine = views[key]
        assert mine["rows"] and {row["tenant"] for row in mine["rows"]} == {tenant}, key
        ids = {row["id"] for row in mine["rows"]}
        assert all(o < 0 or o in ids for o in mine["blocks"]["owner"]), key   # no other key's request ids
    # the pool as one tenant sees it: how full, never whose (the same snapshot, filtered)
    bobs = engine_view.tenant_view(everyone, "key-1")
    assert [o >= 0 or o == engine_view.OTHERS for o in bobs["blocks"]["owner"]] == \
        [o >= 0 for o in everyone["blocks"]["owner"]]


def test_max_waiting_per_key_refuses_one_keys_excess_and_still_admits_anothers(tiny_model_dir):
    """2 seats and --max-waiting-per-key 1: alice's six at once get three in (2 seats + 1) and three
    503s naming the option; bob's one, sent after them, is answered."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, max_num_seqs=2, max_num_batched_tokens=64)
    ops = server_ops.ServerOps(api_key=(ALICE, BOB), max_waiting=8, max_waiting_per_key=1)
    app = server.make_app(engine, ops=ops)
    body = {"prompt": "Count to ten.", "max_tokens": 8, "ignore_eos": True}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            post = lambda key: client.post("/v1/completions", json=body, headers=bearer(key))  # noqa: E731
            alice = [asyncio.create_task(post(ALICE)) for _ in range(6)]
            deadline = time.monotonic() + 30
            while ops.admission.held["key-0"] < 3:   # alice's share is taken: bob comes while it is held
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            bob = await post(BOB)
            return await asyncio.gather(*alice), bob

    try:
        alice, bob = asyncio.run(scenario())
    finally:
        engine.close()
    assert sorted(r.status_code for r in alice) == [200] * 3 + [503] * 3
    assert all("--max-waiting-per-key" in r.json()["error"]["message"] for r in alice if r.status_code == 503)
    assert bob.status_code == 200
    assert not +ops.admission.held   # every key's share given back


def test_on_a_one_at_a_time_engine_a_keys_waiting_requests_count_in_its_share(tiny_engine):
    """Chapter 1's engine has one seat: with --max-waiting-per-key 1 a key holds two requests
    (one running, one waiting for the lock) and its third gets the 503 at once."""
    ops = server_ops.ServerOps(api_key=(ALICE, BOB), max_waiting_per_key=1)
    app = server.make_app(tiny_engine, ops=ops)
    body = {"prompt": "Count to ten.", "max_tokens": 8, "ignore_eos": True}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body, headers=bearer(ALICE))
                                          for _ in range(3)))

    assert sorted(r.status_code for r in asyncio.run(scenario())) == [200, 200, 503]
    assert not +ops.admission.held
