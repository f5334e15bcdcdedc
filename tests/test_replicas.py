"""Chapter 18: 05_server.py --replicas 2 on a local Ray (started once for the module, tiny model).

Greedy answers through the replicas equal the library's; the prefix router keeps a tenant's
prefix on one replica; /metrics labels each replica's series; a replica killed mid-stream ends
its streams with an error event (non-streamed: 503) and the service answers again; the
autoscaling flags reach Ray's deployment config; stopping the server leaves no Ray process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import REPO_ROOT, load_script

pytest.importorskip("ray.serve")
server_script = load_script("05_server")

STARTUP_S = 180
PROMPT = "The three primary colours are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_descendants(proc: psutil.Process) -> list[psutil.Process]:
    """The server's Ray processes: every descendant (raylet, GCS, workers, the replicas)."""
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "05_server.py", "--engine", "minivllm:LLM", "--model", str(tiny_model_dir),
                             "--device", "cpu", "--replicas", "2", "--cpus-per-replica", "1", "--prefix-caching",
                             "--port", str(port)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + STARTUP_S
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "".join(log)[-3000:]
        time.sleep(1)
    yield {"url": url, "proc": proc, "log": log}
    if proc.poll() is None:
        proc.kill()


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, **body}, timeout=60)


def test_greedy_answers_equal_the_library(served, tiny_model_dir):
    from minivllm import LLM
    from minivllm.contracts import SamplingParams
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        want = [llm.generate(p, SamplingParams(max_tokens=12, ignore_eos=True)).text
                for p in (PROMPT, "Once upon a time", "def add(a, b):")]
    got = [complete(served["url"], prompt=p, ignore_eos=True).json()["choices"][0]["text"]
           for p in (PROMPT, "Once upon a time", "def add(a, b):")]
    assert got == want


def test_a_request_the_replica_refuses_is_a_400_with_its_reason(served):
    r = complete(served["url"], prompt=[1] * 500, max_tokens=100)   # 600 tokens: more than the 512 window
    assert r.status_code == 400, r.text
    assert "Traceback" not in r.text and "ray" not in r.json()["error"]["message"].lower()


def test_a_tenants_prefix_stays_on_one_replica(served):
    url = served["url"]
    system = " ".join(f"rule {n}: be brief." for n in range(40))   # well over a few 16-token blocks
    before = httpx.get(url + "/engine/stats").json()["replicas"]
    for n in range(6):
        assert complete(url, prompt=f"{system} Question {n}?", max_tokens=2, cache_salt="tenant-a").status_code == 200
    after = httpx.get(url + "/engine/stats").json()["replicas"]
    hits = {r: s["prefix_cache_hits"] - before.get(r, {}).get("prefix_cache_hits", 0) for r, s in after.items()}
    queried = {r: s["prefix_cache_queries"] - before.get(r, {}).get("prefix_cache_queries", 0) for r, s in after.items()}
    assert sorted(q > 0 for q in queried.values()) == [False, True] or len(after) == 1, queried   # one replica
    assert sum(hits.values()) >= 5 * 16, hits          # the five later requests found the prefix warm
    metrics = httpx.get(url + "/metrics").text
    for replica in after:
        assert f'llm_prefix_cache_hits_by_replica_total{{replica="{replica}"}}' in metrics


def stream_events(url: str, out: list, max_tokens: int) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        events.append(f"client error {exc!r}")
    out.append(events)


def replica_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in ray_descendants(psutil.Process(proc.pid))
            if "ServeReplica" in " ".join(p.cmdline() or [])]


def test_a_killed_replica_ends_its_streams_and_the_service_recovers(served):
    url, proc = served["url"], served["proc"]
    results: list = []
    threads = [threading.Thread(target=stream_events, args=(url, results, 480)) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)   # the streams are running
    victims = replica_processes(proc)
    assert len(victims) == 2
    victims[0].kill()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    assert len(results) == 8
    assert all(events and events[-1] == "[DONE]" for events in results), [e[-2:] for e in results]
    errors = [e for events in results for e in events if '"error"' in e]
    assert errors, "no stream saw the replica die"
    assert all(json.loads(e)["error"]["code"] in (503, "503") or "unavailable" in e for e in errors)
    deadline = time.monotonic() + 60   # the live replica answers; Ray brings the dead one back
    while complete(url).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(1)


def test_a_non_streamed_answer_on_a_dead_replica_is_a_503(served):
    url, proc = served["url"], served["proc"]
    deadline = time.monotonic() + 90
    while len(replica_processes(proc)) < 2:   # Ray has restarted the replica killed above
        assert time.monotonic() < deadline
        time.sleep(1)
    statuses: list = []
    threads = [threading.Thread(target=lambda: statuses.append(
        complete(url, max_tokens=480, ignore_eos=True).status_code)) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    for p in replica_processes(proc):
        p.kill()
    for t in threads:
        t.join(timeout=60)
    assert len(statuses) == 4 and 503 in statuses and set(statuses) <= {200, 503}, statuses


def test_autoscaling_flags_reach_rays_deployment_config():
    from ray import serve

    from kit import replica_server
    args = server_script.arguments().parse_args(["--replicas", "1", "--min-replicas", "1", "--max-replicas", "3",
                                                 "--target-ongoing-requests", "5", "--router", "pow2"])
    deployment = serve.deployment(replica_server.EngineReplica, **replica_server.deployment_options(args))
    config = deployment._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 3, 5)
    for bad in (["--min-replicas", "3", "--max-replicas", "2"], ["--min-replicas", "1"]):
        with pytest.raises(ValueError):
            replica_server.deployment_options(server_script.arguments().parse_args(["--replicas", "1", *bad]))


def test_stopping_the_server_stops_every_ray_process(served):
    proc = served["proc"]
    ray_procs = ray_descendants(psutil.Process(proc.pid))
    assert any("raylet" in " ".join(p.cmdline() or []) for p in ray_procs)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    gone, alive = psutil.wait_procs(ray_procs, timeout=30)
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]


def test_the_default_server_never_imports_ray():
    code = ("import sys; sys.path.insert(0, '.'); import importlib; s = importlib.import_module('05_server'); "
            "s.arguments().parse_args([]); print('RAY' if any(m.split('.')[0] == 'ray' for m in sys.modules) else 'NO')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("NO"), out.stderr[-2000:]


def test_replicas_refuse_an_engine_that_does_not_batch_before_ray_starts():
    out = subprocess.run([sys.executable, "05_server.py", "--replicas", "2", "--engine", "04_engine:BaselineEngine"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "schedules itself" in out.stderr, out.stderr[-2000:]
    assert "Ray instance" not in out.stderr
