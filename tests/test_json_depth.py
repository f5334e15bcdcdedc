"""A body's JSON nesting is bounded by the server, not by the process's recursion limit.

Python's json module recurses once per level, and torch.compile raises the recursion limit
(to 2,000 when it compiles from a cold cache): left to json, how deep a body may nest would
depend on what else the process has done. kit/openai_api.JsonDepth counts the depth as the
body arrives and refuses anything deeper than MAX_JSON_DEPTH with the same 400 everywhere.
"""

import json
import sys

import pytest
from fastapi.testclient import TestClient

from kit import openai_api as api
from kit.openai_api import MAX_JSON_DEPTH, JsonDepth
from conftest import load_script

server = load_script("05_server")


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * (depth - 1) + b'"hi"' + b"]" * (depth - 1) + b"}"


def test_depth_counts_brackets_outside_strings_across_pieces():
    counter = JsonDepth(limit=3)
    for piece in (b'{"a": "[[[[{{{{", "b\\\\": ', b'"\\"[[[[", ', b'"c": [[1]]}'):
        counter.feed(piece)          # brackets in strings, escaped quotes, a split body
    assert counter.depth == 0 and not counter.in_string
    with pytest.raises(Exception, match="more than 3 levels"):
        JsonDepth(limit=3).feed(b'{"a": [[[1]]]}')


@pytest.mark.parametrize("limit", [1000, 5000])
def test_too_deep_is_a_400_whatever_the_recursion_limit(tiny_engine, limit):
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        with TestClient(server.make_app(tiny_engine)) as client:
            deep = client.post("/v1/completions", content=nested(MAX_JSON_DEPTH + 1),
                               headers={"Content-Type": "application/json"})
            fine = client.post("/v1/completions", content=nested(MAX_JSON_DEPTH),
                               headers={"Content-Type": "application/json"})
    finally:
        sys.setrecursionlimit(before)
    assert deep.status_code == 400
    assert deep.json()["error"]["message"] == f"the body's JSON is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
    # As deep as allowed, the body is read and judged on its fields instead.
    assert fine.status_code == 400 and "nested" not in fine.json()["error"]["message"]


def test_a_deep_schema_within_the_bound_still_reads(tiny_engine):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "s", "schema": schema}}}
    with TestClient(server.make_app(tiny_engine)) as client:
        r = client.post("/v1/chat/completions", content=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert api.MAX_JSON_DEPTH >= 32
