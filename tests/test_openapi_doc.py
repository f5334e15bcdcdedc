"""The OpenAPI document lists every status each route answers, with OpenAI's error body."""

from __future__ import annotations

import importlib

from fastapi.testclient import TestClient

from conftest import load_script

server = load_script("05_server")
ops_lib = importlib.import_module("kit.server_ops")


def test_the_document_lists_the_statuses_the_routes_answer(tiny_engine):
    app = server.make_app(tiny_engine, ops=ops_lib.ServerOps(api_key="k"), max_body_bytes=4096)
    key = {"Authorization": "Bearer k"}
    with TestClient(app) as c:
        doc = c.get("/openapi.json").json()
        answered = {   # (path as documented, method): statuses seen from the server just now
            ("/v1/completions", "post"): {
                c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4.5}, headers=key).status_code,
                c.post("/v1/completions", json={"prompt": "Hi"}).status_code,
                c.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-9"}, headers=key).status_code,
                c.post("/v1/completions", json={"prompt": "x" * 5000}, headers=key).status_code,
                c.post("/v1/completions", content=b"prompt=Hi", headers={**key, "Content-Type": "text/plain"}).status_code},
            ("/v1/models/{model}", "get"): {c.get("/v1/models/gpt-9", headers=key).status_code},
            ("/engine/scheduler", "get"): {c.get("/engine/scheduler?since=x", headers=key).status_code,
                                           c.get("/engine/scheduler").status_code},
        }
        r = c.get("/v1/completions", headers=key)
        assert r.status_code == 405 and r.headers["Allow"] == "POST"   # RFC 9110: a 405 says what is allowed
    assert answered[("/v1/completions", "post")] == {400, 401, 404, 413, 415}
    for (path, method), seen in answered.items():
        responses = doc["paths"][path][method]["responses"]
        assert seen <= {int(s) for s in responses}, (path, seen, sorted(responses))
        assert "422" not in responses   # FastAPI's validation status: this server answers 400
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "408", "413", "415", "503", "504"} <= set(chat)
    assert chat["503"]["headers"]["Retry-After"]
    error = chat["400"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    fields = doc["components"]["schemas"][error]["properties"]["error"]["$ref"].rsplit("/", 1)[1]
    assert set(doc["components"]["schemas"][fields]["properties"]) == {"message", "type", "param", "code"}
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200", "400"}
