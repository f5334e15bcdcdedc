"""server_ops.py through 05_server's app: API keys, /metrics, overload 503, request timeout, SIGTERM."""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO_ROOT, load_script
from minivllm import LLM
from minivllm.contracts import BaseOfflineEngine
from test_server import asgi_request

server = load_script("05_server")
ops_lib = importlib.import_module("kit.server_ops")
launcher = importlib.import_module("kit.launcher")
HELLO = [{"role": "user", "content": "Hello!"}]


def metric_values(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_api_key_guards_every_v1_route_and_health_stays_open(tiny_engine):
    app = server.make_app(tiny_engine, ops=ops_lib.ServerOps(api_key="s3cret"))
    routes = [("get", "/v1/models", None),
              ("post", "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}),
              ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})]
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            ok = c.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200, (path, ok.text)


def test_openai_client_works_with_api_key(tiny_engine):
    openai = pytest.importorskip("openai")
    app = server.make_app(tiny_engine, model_name="tiny", ops=ops_lib.ServerOps(api_key="s3cret"))
    with TestClient(app) as c:
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=c, max_retries=0)
        reply = good.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
        assert reply.choices[0].message.content is not None
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=c, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_metrics_count_exactly_the_tokens_served(tiny_engine):
    with TestClient(server.make_app(tiny_engine)) as c:
        replies = [c.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 5}).json(),
                   c.post("/v1/completions", json={"prompt": ["Hi", "Sea"], "max_tokens": 4}).json()]
        with c.stream("POST", "/v1/chat/completions",
                      json={"messages": HELLO, "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        replies.append(next(e for e in events if e.get("usage")))
        values = metric_values(c.get("/metrics").text)
    prompt = sum(r["usage"]["prompt_tokens"] for r in replies)
    generated = sum(r["usage"]["completion_tokens"] for r in replies)
    assert values[("llm_prompt_tokens_total", ())] == prompt
    assert values[("llm_generation_tokens_total", ())] == generated
    assert values[("llm_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 2
    assert values[("llm_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert values[("llm_e2e_request_latency_seconds_count", ())] == 3
    # Non-streamed replies count a TTFT only where the engine measured one.
    measured = [isinstance(r["metrics"], dict) and r["metrics"].get("ttft_ms") is not None
                or isinstance(r["metrics"], list) and all(m.get("ttft_ms") is not None for m in r["metrics"])
                for r in replies[:2]]
    assert values[("llm_time_to_first_token_seconds_count", ())] == 1 + sum(measured)
    assert values[("llm_requests_waiting", ())] == 0 and values[("llm_requests_running", ())] == 0


FEATURES = {"quant": "int8", "prefix_caching": True, "kv_memory": 512 << 20, "block_size": 16,
            "max_num_seqs": 32, "max_num_batched_tokens": 256}


class FeaturedEngine:
    """The tiny engine, reporting features as the engines on our own model do."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def features(self) -> dict:
        return dict(FEATURES)


def test_engine_features_show_in_stats_and_metrics(tiny_engine):
    with TestClient(server.make_app(FeaturedEngine(tiny_engine))) as c:
        assert c.get("/engine/stats").json()["features"] == FEATURES
        values = metric_values(c.get("/metrics").text)
    labels = tuple(sorted((k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in FEATURES.items()))
    assert values[("llm_engine_features", labels)] == 1   # an info metric: the settings are its labels
    with TestClient(server.make_app(tiny_engine)) as c:   # Chapter 1's engine was built with nothing to show
        assert "features" not in c.get("/engine/stats").json()
        assert "llm_engine_features" not in c.get("/metrics").text


class GatedEngine(BaseOfflineEngine):
    """An engine whose generate waits until the test opens the gate: a deterministic 'slow' engine."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.gate = inner, inner.tokenizer, threading.Event()

    def generate(self, prompt, max_new_tokens, params=None):
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.generate(prompt, max_new_tokens, params)

    def generate_batch(self, prompts, max_new_tokens, params=None):
        return [self.generate(p, max_new_tokens, params) for p in prompts]


def test_max_waiting_answers_503_at_once_and_the_queue_still_serves(tiny_engine):
    engine, ops = GatedEngine(tiny_engine), ops_lib.ServerOps(max_waiting=2)
    body = {"messages": HELLO, "max_tokens": 2}
    with TestClient(server.make_app(engine, ops=ops)) as c:
        statuses = []
        threads = [threading.Thread(target=lambda: statuses.append(
            c.post("/v1/chat/completions", json=body).status_code)) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while c.get("/engine/stats").json()["waiting"] < 2:   # one running, two waiting
            assert time.monotonic() < deadline, c.get("/engine/stats").json()
            time.sleep(0.02)
        fourth = c.post("/v1/chat/completions", json=body)   # the gate is still shut: no one finished
        assert not statuses
        engine.gate.set()
        for t in threads:
            t.join(60)
    assert fourth.status_code == 503 and fourth.headers["Retry-After"].isdigit()
    assert fourth.json()["error"]["type"] == "server_error"
    assert statuses == [200, 200, 200]


class EndlessStreamEngine(BaseOfflineEngine):
    """Streams a token forever; records whether its iterator was closed (its work freed)."""

    def __init__(self, inner):
        self.tokenizer, self.closed = inner.tokenizer, threading.Event()

    def capabilities(self):
        return super().capabilities().replace(streams=True)

    def generate_stream(self, prompt, max_new_tokens, params=None):
        try:
            while True:
                time.sleep(0.01)
                yield "tok "
        finally:
            self.closed.set()

    def generate(self, *a, **k):
        raise NotImplementedError

    generate_batch = generate


def test_request_timeout_ends_a_stream_with_an_error_and_frees_its_work(tiny_engine):
    engine = EndlessStreamEngine(tiny_engine)
    with TestClient(server.make_app(engine, ops=ops_lib.ServerOps(request_timeout=0.5))) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert "request-timeout" in json.loads(events[-2])["error"]["message"]
        assert events[-1] == "[DONE]"
        assert engine.closed.wait(10)
        assert c.get("/engine/stats").json()["running"] == 0


def test_sigterm_mid_stream_ends_the_stream_and_exits_0(tiny_model_dir):
    port = launcher.free_port()
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "05_server.py"), "--port", str(port),
                             "--model", str(tiny_model_dir), "--device", "cpu", "--shutdown-grace", "1",
                             "--access-log"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert launcher.wait_until_healthy(url, proc), "the server did not come up"
        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)
        last_json = json.loads(events[-2])
        assert events[-1] == "[DONE]"
        assert "error" in last_json or last_json["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        log = proc.stdout.read()
        # The access line, without the prompt text: a stream the shutdown ended is no success, and
        # it counts the tokens it did generate.
        line = re.search(r"/v1/completions (\d+) prompt=(\d+) output=(\d+)", log)
        status, prompt, output = map(int, line.groups())
        assert (status, output) == (200, 400) if "error" not in last_json else status == 503 and output >= 1
        assert prompt >= 1
        assert "Once" not in log.split("[server]")[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_label_routes_not_raw_paths_and_stay_small(tiny_engine):
    """Made-up paths (404s, and 401s under a key) all count as one 'other' series: a client
    cannot grow /metrics, whose every scrape formats every series."""
    with TestClient(server.make_app(tiny_engine, ops=ops_lib.ServerOps(api_key="k", admin_key="a"))) as c:
        small = len(c.get("/metrics", headers={"Authorization": "Bearer a"}).content)
        for i in range(300):
            assert c.get(f"/junk/{i}").status_code == 404
            assert c.get(f"/v1/junk/{i}").status_code == 401
        assert c.get("/static/../../etc/passwd").status_code == 404
        text = c.get("/metrics", headers={"Authorization": "Bearer a"}).text
    endpoints = {s.labels["endpoint"] for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == "llm_requests_total"}
    assert endpoints <= {"other", "/metrics", "/static"}, endpoints
    values = metric_values(text)
    assert values[("llm_requests_total", (("endpoint", "other"), ("status", "404")))] == 301   # the client
    assert values[("llm_requests_total", (("endpoint", "other"), ("status", "401")))] == 300   # made it /etc/passwd
    assert len(text) < small + 2000


def test_the_access_log_escapes_control_characters(tiny_engine, caplog):
    app = server.make_app(tiny_engine, ops=ops_lib.ServerOps(access_log=True))
    with TestClient(app) as c, caplog.at_level("INFO", logger="05_server.access"):
        c.get("/x%0a2026-01-01 05_server.access forged 200")
        c.get("/y%00z%1b[31m")
    lines = [r.getMessage() for r in caplog.records if r.name == "05_server.access"]
    assert len(lines) == 2 and not any(ch in "".join(lines) for ch in "\n\x00\x1b")
    assert "/x\\n2026-01-01" in lines[0] and "/y\\x00z\\x1b[31m" in lines[1]


def test_a_body_that_never_arrives_whole_is_a_408(tiny_engine):
    """A Content-Length larger than what is sent: without a deadline the request waits for ever."""
    app = server.make_app(tiny_engine, ops=ops_lib.ServerOps(body_timeout=0.3))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}
    parts, sent = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}], []

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.Event().wait()   # the rest never comes, and the client never leaves

    async def send(message):
        sent.append(message)

    async def run():
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), timeout=10)
    asyncio.run(run())
    assert sent[0]["status"] == 408 and b"did not arrive within 0.3 seconds" in sent[1]["body"]


def test_a_stream_whose_client_left_is_a_499_with_its_tokens(tiny_engine):
    """Not a 200 with no tokens: /metrics, the served count and the access log say what happened."""
    app = server.make_app(tiny_engine)

    async def scenario():
        sent = await asgi_request(app, {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True},
                                  hang_up_after=5)
        assert sent[0]["status"] == 200
    asyncio.run(scenario())
    with TestClient(app) as c:
        values = metric_values(c.get("/metrics").text)
        served = c.get("/engine/stats").json()["served"]
    assert values.get(("llm_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))) is None
    assert values[("llm_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))] == 1
    assert served == 0
    assert values[("llm_prompt_tokens_total", ())] == len(tiny_engine.tokenizer("Once").input_ids)
    assert 4 <= values[("llm_generation_tokens_total", ())] < 300


def test_metrics_and_stats_need_a_key_when_the_api_has_one(tiny_engine):
    bearer = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
    with TestClient(server.make_app(tiny_engine, ops=ops_lib.ServerOps(api_key="k"))) as c:
        for path in ("/metrics", "/engine/stats", "/engine/scheduler"):
            assert c.get(path).status_code == 401
            # /metrics is the whole service's: a tenant's key never reads it, only --metrics/--admin-key
            assert c.get(path, headers=bearer("k")).status_code == (401 if path == "/metrics" else 200)
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "bearer k"}).status_code == 200   # any case
        assert c.get("/v1/models", headers={"Authorization": "BEARER  k"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Basic k"}).status_code == 401
    ops = ops_lib.ServerOps(api_key="k", metrics_key="m")   # Prometheus gets a key of its own
    with TestClient(server.make_app(tiny_engine, ops=ops)) as c:
        assert c.get("/metrics", headers=bearer("k")).status_code == 401
        assert c.get("/metrics", headers=bearer("m")).status_code == 200
        assert c.get("/v1/models", headers=bearer("m")).status_code == 401


def test_only_the_bound_host_names_are_answered(tiny_engine):
    """DNS rebinding: a page on evil.example, its name pointed at 127.0.0.1, still sends its own Host."""
    assert ops_lib.served_hosts("0.0.0.0", None) is None and ops_lib.served_hosts("127.0.0.1", "*") is None
    ops = ops_lib.ServerOps(allowed_hosts=ops_lib.served_hosts("127.0.0.1", None))
    with TestClient(server.make_app(tiny_engine, ops=ops)) as c:
        for host in ("127.0.0.1:8001", "localhost", "LOCALHOST:8001", "[::1]:8001"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8001", "127.0.0.1.evil.example", ""):
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"Host": host})
            assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"], host
    ops = ops_lib.ServerOps(allowed_hosts=ops_lib.served_hosts("127.0.0.1", "llm.lan"))
    with TestClient(server.make_app(tiny_engine, ops=ops)) as c:
        assert c.get("/health", headers={"Host": "llm.lan:80"}).status_code == 200
        assert c.get("/health", headers={"Host": "localhost"}).status_code == 400


def test_each_api_key_is_a_tenant_with_a_prefix_cache_of_its_own(tiny_model_dir, tmp_path):
    """Two keys, one server with prefix caching: B's exact copy of A's prompt gets cached_tokens 0
    (and no faster first token), A's own repeat gets its blocks back. A key file adds keys."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, block_size=16, prefix_caching=True)
    keys = tmp_path / "keys.txt"
    keys.write_text("# the class\nkey-for-bob\n\n")
    parser = __import__("argparse").ArgumentParser()
    ops_lib.add_arguments(parser)
    args = parser.parse_args(["--api-key", "key-for-alice", "--api-keys-file", str(keys)])
    args.host, args.allowed_hosts = "127.0.0.1", "*"   # TestClient says Host: testserver
    ops = ops_lib.ServerOps.from_args(args)
    assert ops.api_keys == ("key-for-alice", "key-for-bob")
    memo = "Alice's memo: the merger closes on Friday at a price of 41 dollars a share, keep it quiet. " * 2
    try:
        with TestClient(server.make_app(engine, ops=ops)) as client:
            def cached(key, **extra):
                r = client.post("/v1/completions", json={"prompt": memo, "max_tokens": 1, **extra},
                                headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
                return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

            assert cached("key-for-alice") == 0
            assert cached("key-for-bob") == 0                          # another tenant: nothing to learn
            assert cached("key-for-bob", cache_salt="x") == 0          # nor with a salt of its own choosing
            assert cached("key-for-alice") > 0                         # the same tenant: its blocks again
            assert client.post("/v1/completions", json={"prompt": "hi"},
                               headers={"Authorization": "Bearer key-for-eve"}).status_code == 401
    finally:
        engine.close()


def test_api_keys_are_checked_when_the_server_starts():
    for bad in (("a", "a"), ("with space",), ("",)):
        with pytest.raises(ValueError, match="API keys"):
            ops_lib.ServerOps(api_key=bad)


def test_a_second_signal_exits_at_once_and_cleanly(tiny_model_dir):
    """An impatient operator: SIGTERM starts the drain, SIGINT during it ends the process now,
    with exit code 1 and one line, not a C++ abort from threads torn down mid-generation."""
    port = launcher.free_port()
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "05_server.py"), "--port", str(port),
                             "--model", str(tiny_model_dir), "--device", "cpu", "--shutdown-grace", "10"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def stream():
        try:
            body = {"prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass   # cut off: that is the point

    try:
        assert launcher.wait_until_healthy(url, proc), "the server did not come up"
        clients = [threading.Thread(target=stream) for _ in range(3)]
        for c in clients:
            c.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 1
        log = proc.stdout.read()
        assert "second signal: exiting now" in log and "terminate called" not in log
        for c in clients:
            c.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_urls_to_give_a_class():
    lan = {socket.AF_INET: ["192.168.1.20", "10.0.0.5"], socket.AF_INET6: ["fd00::2"]}
    addresses = lan.get
    assert ops_lib.page_urls("0.0.0.0", 8001, addresses) == ["http://192.168.1.20:8001/", "http://10.0.0.5:8001/"]
    assert ops_lib.page_urls("::", 8001, addresses)[-1] == "http://[fd00::2]:8001/"   # IPv6 too, bracketed
    assert ops_lib.page_urls("127.0.0.1", 8001, addresses) == ["http://127.0.0.1:8001/"]
    assert ops_lib.page_urls("::1", 9000, addresses) == ["http://[::1]:9000/"]
    text = ops_lib.startup_lines("04_engine:BaselineEngine", "0.0.0.0", 8001, "class-secret", addresses)
    assert "the page: http://192.168.1.20:8001/" in text and "or: http://10.0.0.5:8001/" in text
    assert "API base URL: http://192.168.1.20:8001/v1" in text and "on this machine: http://127.0.0.1:8001/" in text
    assert "asks for the key once" in text and "class-secret" not in text   # the key itself is never printed
    here = ops_lib.startup_lines("04_engine:BaselineEngine", "127.0.0.1", 8001, None, addresses)
    assert "192.168" not in here and "API base URL: http://127.0.0.1:8001/v1" in here and "key" not in here
    alone = ops_lib.startup_lines("x", "0.0.0.0", 8001, None, lambda family: [])
    assert "no network address found" in alone and "API base URL: http://127.0.0.1:8001/v1" in alone


def test_lan_addresses_leave_out_loopback_and_link_local(monkeypatch):
    class NoRoute:   # an offline machine: no route to probe
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def connect(self, address):
            raise OSError("Network is unreachable")

    found = ["127.0.1.1", "192.168.1.20", "169.254.3.4", "192.168.1.20"]   # Debian's 127.0.1.1; a repeat
    monkeypatch.setattr(ops_lib.socket, "socket", NoRoute)
    monkeypatch.setattr(ops_lib.socket, "getaddrinfo", lambda *a: [(2, 2, 17, "", (ip, 0)) for ip in found])
    assert ops_lib.lan_addresses() == ["192.168.1.20"]
    monkeypatch.setattr(ops_lib.socket, "getaddrinfo", lambda *a: (_ for _ in ()).throw(socket.gaierror("no name")))
    assert ops_lib.lan_addresses() == []


def test_lan_addresses_on_this_machine():
    for address in ops_lib.lan_addresses():
        assert not ipaddress.ip_address(address).is_loopback, address
