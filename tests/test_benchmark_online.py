"""06_benchmark_online.py: the request shapes, SSE timing, the load patterns, and one real run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from conftest import REPO_ROOT, load_script
from kit import bench, cli, launcher, workloads

online = load_script("06_benchmark_online")


def sse_body(events: list) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def run_send(handler, path="/v1/completions", body=None):
    body = body or {"stream": True, "prompt": "hi", "max_tokens": 3}

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            return await online.send(client, path, body)
    return asyncio.run(go())


def test_requests_go_to_the_endpoint_of_their_kind():
    path, body = online.request_for({"text": "The sky is"}, "m", 16, ignore_eos=True, stream=True)
    assert path == "/v1/completions" and body["prompt"] == "The sky is"
    assert body["max_tokens"] == 16 and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    chat = [{"role": "user", "content": "Hi"}]
    path, body = online.request_for({"messages": chat}, "m", 16, ignore_eos=False, stream=False)
    assert path == "/v1/chat/completions" and body["messages"] == chat
    assert "ignore_eos" not in body and "stream_options" not in body and body["stream"] is False


def test_streamed_chunks_give_ttft_gaps_and_usage_counts():
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},   # no text: not a token
              {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
              {"choices": [{"delta": {"content": "!"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}, "[DONE]"]
    record = run_send(lambda request: httpx.Response(200, content=sse_body(chunks)), "/v1/chat/completions")
    assert record.error is None and (record.input_tokens, record.output_tokens) == (9, 3)
    assert len(record.itl_ms) == 2 and record.ttft_ms is not None and record.ttft_ms <= record.latency_ms
    assert record.tpot_ms == pytest.approx((record.latency_ms - record.ttft_ms) / 2)


def test_without_usage_the_chunks_are_counted():
    chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "c", "d")] + ["[DONE]"]
    record = run_send(lambda request: httpx.Response(200, content=sse_body(chunks)))
    assert record.error is None and record.output_tokens == 4 and len(record.itl_ms) == 3


@pytest.mark.parametrize("handler, expected", [
    (lambda r: httpx.Response(400, json={"error": {"message": "prompt too long"}}), "HTTP 400"),
    (lambda r: httpx.Response(200, content=sse_body([{"choices": [{"text": "a"}]},
                                                     {"error": {"message": "engine crashed"}}, "[DONE]"])),
     "engine crashed"),
    (lambda r: httpx.Response(200, content=b"data: {not json\n\n"), "JSONDecodeError"),
])
def test_failures_become_records_not_crashes(handler, expected):
    record = run_send(handler)
    assert record.error is not None and expected in record.error and record.output_tokens == 0


def test_unreachable_server_is_a_failed_request():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)
    assert "ConnectError" in run_send(refuse).error


def test_plain_replies_use_usage():
    reply = {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}}
    record = run_send(lambda r: httpx.Response(200, json=reply), body={"stream": False, "prompt": "x"})
    assert (record.output_tokens, record.ttft_ms, record.itl_ms) == (5, None, [])


def test_poisson_schedule_is_seeded_and_has_the_requested_rate():
    times = online.arrival_times(20_000, rate=4.0, seed=1)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert times == online.arrival_times(20_000, rate=4.0, seed=1)          # same seed, same users
    assert times != online.arrival_times(20_000, rate=4.0, seed=2)
    assert np.mean(np.diff(times)) == pytest.approx(0.25, rel=0.03)          # mean gap 1/rate
    assert np.std(np.diff(times)) == pytest.approx(0.25, rel=0.03)           # exponential: std == mean
    assert online.arrival_times(3, rate=None) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        online.arrival_times(3, rate=0.0)


class NoBar:
    def update(self, n: int) -> None:
        pass


@pytest.mark.parametrize("concurrency, expected_peak", [(1, 1), (3, 3), (None, 8)])
def test_concurrency_caps_requests_in_flight(concurrency, expected_peak):
    in_flight, peak = 0, 0

    async def handler(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, content=sse_body([{"choices": [{"text": "a"}]}, "[DONE]"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            jobs = [("/v1/completions", {"stream": True, "prompt": "x"})] * 8
            return await online.run_load(client, jobs, concurrency, [0.0] * 8, NoBar())

    records, seconds = asyncio.run(go())
    assert len(records) == 8 and all(r.error is None for r in records) and seconds > 0
    assert peak == expected_peak


def test_with_a_request_rate_the_wait_for_a_free_slot_counts():
    """Arrived requests queue for the one slot: each one's clock started at its arrival (0 here),
    so its latency covers the requests served before it, as for a server's own queue."""
    served = []   # (start, end) of each request at the "server"

    async def handler(request):
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        served.append((start, time.perf_counter()))
        return httpx.Response(200, content=sse_body([{"choices": [{"text": "a"}]}, "[DONE]"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            jobs = [("/v1/completions", {"stream": True, "prompt": "x"})] * 4
            return await online.run_load(client, jobs, 1, [0.0] * 4, NoBar(), rate_given=True)

    records, seconds = asyncio.run(go())
    first_start = served[0][0]
    for record, (_, end) in zip(sorted(records, key=lambda r: r.latency_ms), served):
        assert record.latency_ms >= (end - first_start) * 1000
        assert record.ttft_ms >= (end - first_start) * 1000   # the first token, too, is timed from arrival
    assert max(r.latency_ms for r in records) <= seconds * 1000


def test_url_and_engine_are_exclusive():
    with pytest.raises(SystemExit):
        online.main(["--url", "http://127.0.0.1:1", "--engine", "04_engine:BaselineEngine"])


def test_a_server_that_cannot_start_is_reported():
    with pytest.raises(RuntimeError, match="did not come up"):
        with online.launched_server("no_such_module:Engine", None, "cpu", timeout_s=120):
            pass


def test_real_run_against_the_server(tiny_model_dir, tmp_path, monkeypatch):
    urls = []
    real_launch = online.launched_server

    @contextlib.contextmanager
    def spy(*args, **kwargs):
        with real_launch(*args, **kwargs) as url:
            urls.append(url)
            yield url
    monkeypatch.setattr(online, "launched_server", spy)

    out, png = tmp_path / "online.json", tmp_path / "online.png"
    online.main(["--model", str(tiny_model_dir), "--device", "cpu", "--num-prompts", "3", "--runs", "1",
                 "--max-new-tokens", "4", "--warmup", "1", "--ignore-eos", "--concurrency", "2", "--json", str(out), "--plot", str(png)])
    (entry,) = json.loads(out.read_text())["results"]
    stats = entry["stats"]
    assert stats["requests"] == 3 and stats["failed"] == 0
    assert stats["output_tokens"] == 12                       # counted by the server, 4 each
    assert [r["input_tokens"] > 0 for r in entry["requests"]] == [True] * 3
    assert 0 < stats["ttft_ms"]["p50"] <= stats["latency_ms"]["p50"]
    assert stats["itl_ms"] is not None and stats["tpot_ms"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(httpx.ConnectError):                   # the server was stopped afterwards
        httpx.get(f"{urls[0]}/health", timeout=5)


# --- the mixed workload, goodput, and comparing servers in one run ----------------------------

Record = bench.RequestRecord


def test_goodput_counts_requests_within_the_slo():
    records = [Record(900.0, 1, 5, ttft_ms=200.0, tpot_ms=50.0),
               Record(3000.0, 1, 5, ttft_ms=1000.0, tpot_ms=200.0),   # exactly at the limit: met
               Record(3000.0, 1, 5, ttft_ms=1500.0, tpot_ms=10.0),    # first token too late
               Record(300.0, 1, 1, ttft_ms=300.0, tpot_ms=None),      # one token: no TPOT to miss
               Record(5.0, error="HTTP 503: overloaded"),             # a failure never meets it
               Record(800.0, 1, 5)]                                   # TTFT not measured (no streaming)
    assert online.goodput(records, 2.0, slo_ttft_ms=1000) == {"met": 3, "sent": 6, "share": 0.5, "per_s": 1.5}
    assert online.goodput(records, 2.0, slo_ttft_ms=1000, slo_tpot_ms=100) == {
        "met": 2, "sent": 6, "share": pytest.approx(1 / 3), "per_s": 1.0}
    assert online.goodput([], 1.0, 1000)["share"] == 0.0
    for bad in ({"duration_s": 0.0, "slo_ttft_ms": 1000}, {"duration_s": 1.0, "slo_ttft_ms": 0},
                {"duration_s": 1.0, "slo_ttft_ms": 1000, "slo_tpot_ms": -1}):
        with pytest.raises(ValueError):
            online.goodput(records, **bad)


def test_mixed_workload_sends_plain_text_with_each_requests_own_budget(tiny_model_dir):
    args = online.argparse.Namespace(workload="mixed", model=str(tiny_model_dir), num_prompts=6, seed=3)
    requests = online.workload(args)
    spec = workloads.load_workload()["requests"][:6]
    assert [budget for _, budget in requests] == [r["max_tokens"] for r in spec]
    path, body = online.request_for(requests[3][0], "m", requests[3][1], ignore_eos=True, stream=True)
    assert path == "/v1/completions" and body["max_tokens"] == spec[3]["max_tokens"]   # no chat template
    from transformers import AutoTokenizer
    expected = workloads.mixed_workload(AutoTokenizer.from_pretrained(tiny_model_dir), 6, seed=3)
    assert [p["text"] for p, _ in requests] == [w.prompt for w in expected]


def test_servers_alternate_and_goodput_is_compared(monkeypatch, capsys):
    visits = []

    async def fake_measure(url, args, requests, warmup, bar):
        visits.append((url, warmup))
        fast = url.endswith(":2")   # server 2 answers twice as many requests within 1 s
        records = [Record(1000.0, 1, 4, ttft_ms=400.0 if fast or i < 2 else 1600.0, tpot_ms=20.0)
                   for i in range(len(requests))]
        return records, 4.0
    monkeypatch.setattr(online, "measure", fake_measure)
    result = online.main(["--url", "http://h:1", "--url", "http://h:2", "--num-prompts", "4", "--runs", "2",
                          "--warmup", "1", "--concurrency", "4"])
    assert visits == [("http://h:1", 1), ("http://h:2", 1), ("http://h:1", 0), ("http://h:2", 0)]
    assert [g["met"] for g in result["goodput"]] == [4, 8] and result["goodput"][1]["per_s"] == 1.0
    printed = capsys.readouterr().out
    assert "[Goodput: TTFT <= 1000 ms]" in printed
    assert "good requests/s    0.500                 1.000 (2.00x)" in printed
    assert "share              50%                   100%" in printed


@pytest.mark.parametrize("argv, message", [
    (["--slo-ttft-ms", "0"], "argument --slo-ttft-ms: 0 is out of range: greater than 0"),
    (["--slo-tpot-ms", "-5"], "argument --slo-tpot-ms: -5 is out of range"),
    (["--slo-ttft-ms", "nan"], "argument --slo-ttft-ms: nan is not a finite number"),
    (["--request-rate", "nan"], "argument --request-rate: nan is not a finite number"),
    (["--timeout", "0"], "argument --timeout: 0 is out of range"),
    (["--startup-timeout", "inf"], "argument --startup-timeout: inf is not a finite number"),
    (["--workload", "mixed", "--max-new-tokens", "16"], "drop --max-new-tokens"),
    (["--concurrency", "0"], "argument --concurrency: 0 is out of range"),
])
def test_bad_flags_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        online.main(["--url", "http://127.0.0.1:1"] + argv)
    assert message in capsys.readouterr().err


# --- the engine's feature flags, passed on to the servers launched ----------------------------

def test_engine_options_become_the_servers_flags():
    cmd = launcher.server_command(8123, "m", "minivllm:LLM", "cpu",
                                  {"kv_memory": 268435456, "prefix_caching": True, "max_num_seqs": 8,
                                   "quant": "int4", "block_size": None}, args=("--api-key", "k"))
    assert cmd[1:] == [str(launcher.SERVER_SCRIPT), "--host", "127.0.0.1", "--port", "8123",
                       "--engine", "minivllm:LLM", "--model", "m",
                       "--device", "cpu", "--kv-memory", "268435456", "--prefix-caching", "--max-num-seqs", "8",
                       "--quant", "int4", "--api-key", "k"]        # None: not given, the engine's default
    assert launcher.server_command(1) == launcher.server_command(1, engine_options={})
    with pytest.raises(ValueError, match="--prefix-caching can only turn prefix_caching on"):
        launcher.server_command(1, engine_options={"prefix_caching": False})


def test_the_flags_read_back_as_the_same_options():
    # What the benchmark parsed, turned into flags, parses back to the same keywords: the server
    # (which parses them with the same cli.add_engine_options) builds the engine the benchmark asked for.
    parser = argparse.ArgumentParser()
    cli.add_engine_options(parser)
    given = cli.engine_options(parser.parse_args(["--kv-memory", "256MB", "--prefix-caching", "--quant", "int4",
                                                  "--group-size", "64", "--quant-head", "int8", "--block-size", "32",
                                                  "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                                  "--speculative", "draft", "--num-speculative-tokens", "6",
                                                  "--draft-model", "some/folder", "--tensor-parallel-size", "2",
                                                  "--compile", "--enforce-eager", "--dtype", "bfloat16",
                                                  "--gpu-memory-utilization", "0.8", "--seed", "3",
                                                  "--max-model-len", "1024", "--enable-lora", "--max-loras", "2",
                                                  "--max-lora-rank", "8", "--max-cpu-loras", "4"]))
    assert set(given) == set(cli.ENGINE_OPTIONS) - set(cli.PROCESS_OPTIONS)   # --threads: set as it is parsed
    flags = launcher.server_command(1, engine_options=given)[6:]
    assert cli.engine_options(parser.parse_args(flags)) == given


def test_the_server_takes_every_engine_flag():
    proc = subprocess.run([sys.executable, "05_server.py", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    flags = launcher.server_command(1, engine_options={name: 1 for name in cli.ENGINE_OPTIONS})[6::2]
    missing = [flag for flag in flags if flag not in proc.stdout]
    assert not missing, f"05_server.py lacks the engine flags {missing}: it should call cli.add_engine_options"


def test_launched_servers_get_the_engine_flags(monkeypatch):
    launched = []

    @contextlib.contextmanager
    def fake_launch(spec, model, device, timeout_s, engine_options=None):
        launched.append((spec, engine_options))
        yield f"http://h:{len(launched)}"

    async def fake_measure(url, args, requests, warmup, bar):
        return [Record(10.0, 1, 1, ttft_ms=5.0)], 1.0
    monkeypatch.setattr(online, "launched_server", fake_launch)
    monkeypatch.setattr(online, "measure", fake_measure)
    online.main(["--engine", "a:AEngine", "--engine", "b:BEngine", "--num-prompts", "1", "--runs", "1",
                 "--kv-memory", "64MB", "--prefix-caching"])
    options = {"kv_memory": 64 << 20, "prefix_caching": True}
    assert launched == [("a:AEngine", options), ("b:BEngine", options)]
    launched.clear()
    online.main(["--engine", "a:AEngine", "--num-prompts", "1", "--runs", "1"])
    assert launched == [("a:AEngine", {})]


def test_engine_flags_are_refused_with_a_running_server(capsys):
    with pytest.raises(SystemExit):
        online.main(["--url", "http://127.0.0.1:1", "--kv-memory", "64MB"])
    assert "configure the servers launched here: drop them with --url" in capsys.readouterr().err
