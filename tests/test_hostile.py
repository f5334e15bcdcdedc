"""A hostile (or merely unusual) client: requests OpenAI accepts are accepted, a 405 says what is
allowed, and no generation runs without a time bound."""

from __future__ import annotations

import json

import pytest

from fastapi.testclient import TestClient

from conftest import load_script
from kit import server_ops as ops_lib
from test_server_ops import EndlessStreamEngine

server = load_script("05_server")
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


def test_a_whole_float_is_a_token_count_and_a_fraction_is_not(tiny_engine):
    with TestClient(server.make_app(tiny_engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4.0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_completion_tokens": 3.0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        for bad in (4.5, True, "4"):
            assert c.post("/v1/completions", json={"prompt": "Once", "max_tokens": bad}).status_code == 400, bad


def test_an_assistant_turn_of_tool_calls_needs_no_content(tiny_engine):
    with TestClient(server.make_app(tiny_engine)) as c:
        for assistant in ({"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "assistant", "tool_calls": [CALL]}):
            messages = [{"role": "user", "content": "Look it up"}, assistant,
                        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            assert r.status_code == 200, r.text


def test_a_405_names_the_allowed_methods(tiny_engine):
    with TestClient(server.make_app(tiny_engine)) as c:
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()
        r = c.post("/v1/models")
        assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_every_generation_has_a_time_bound_from_its_budget(tiny_engine, monkeypatch):
    ops = ops_lib.ServerOps()
    rec = ops_lib.RequestRecord(route="/v1/completions", ops=ops, budget_tokens=100)
    assert ops.time_limit(rec) == ops_lib.AUTO_TIMEOUT_BASE_S + 100 * ops_lib.AUTO_TIMEOUT_PER_TOKEN_S
    assert ops_lib.ServerOps(request_timeout=5).time_limit(rec) == 5
    assert "per token of its budget" in server.arguments().format_help().replace("\n", " ").replace("  ", " ")
    monkeypatch.setattr(ops_lib, "AUTO_TIMEOUT_BASE_S", 0.3)
    monkeypatch.setattr(ops_lib, "AUTO_TIMEOUT_PER_TOKEN_S", 0.005)
    engine = EndlessStreamEngine(tiny_engine)   # it never stops by itself: only the bound ends it
    with TestClient(server.make_app(engine, ops=ops_lib.ServerOps())) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert "time bound, 0.8s for 100 tokens" in json.loads(events[-2])["error"]["message"]
        assert engine.closed.wait(10)


def test_metrics_need_the_metrics_or_the_admin_key_never_a_tenants(tiny_engine):
    bearer = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
    ops = ops_lib.ServerOps(api_key=("alice", "bob"), admin_key="teacher")
    with TestClient(server.make_app(tiny_engine, ops=ops)) as c:
        assert c.get("/metrics", headers=bearer("alice")).status_code == 401
        assert c.get("/metrics", headers=bearer("teacher")).status_code == 200
        assert c.get("/metrics", headers={"Authorization": "Bearer "}).status_code == 401   # not the empty key
        for path in ("/engine/stats", "/engine/scheduler"):
            assert c.get(path, headers=bearer("teacher")).status_code == 200
        assert c.get("/v1/models", headers=bearer("teacher")).status_code == 401   # a view key, not a tenant
    with TestClient(server.make_app(tiny_engine, ops=ops_lib.ServerOps(api_key="alice"))) as c:
        assert c.get("/metrics", headers=bearer("alice")).status_code == 401
    with pytest.raises(ValueError, match="admin_key must differ"):
        ops_lib.ServerOps(api_key="alice", admin_key="alice")
    args = server.arguments().parse_args(["--admin-key", "teacher"])
    assert ops_lib.ServerOps.from_args(args).admin_key == "teacher"
