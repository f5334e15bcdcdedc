"""05_server.py in front of Chapter 9's engine, minivllm.LLM: live requests share steps.

An engine with `submit` gets no server-side lock: every request goes straight into its
scheduler. These tests check what that must not break: each concurrent answer equals its
sequential one, a client that leaves frees its KV blocks, many requests leave nothing
behind, bad input is refused before it reaches the scheduler, and --max-waiting still holds.
"""

from __future__ import annotations

import importlib

import asyncio
import gc
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import load_script
from kit import cli
from kit.engines import load_engine
from minivllm import LLM
from minivllm.output import Request
from minivllm.text import render_chat
from test_server import asgi_request

server = load_script("05_server")
server_ops = importlib.import_module("kit.server_ops")
launcher = importlib.import_module("kit.launcher")
engine_lib = load_script("04_engine")

QUESTIONS = ["Hello! Who are you?", "Name three colours.", "What is 2 + 2?", "Write a haiku about tea.",
             "Why is the sky blue?", "Say hi in French.", "Count to five.", "What is a GPU?"]


@pytest.fixture(scope="module")
def cb_engine(tiny_model_dir):
    # Small enough that prompts are chunked (64-token budget) and a step carries many sequences.
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20,
                 max_num_seqs=16, max_num_batched_tokens=64)
    yield engine
    engine.close()   # ends the engine loop's thread


def wait_until_idle(engine, timeout_s: float = 10.0) -> None:
    """The engine loop frees an aborted request's blocks at its next step: give it that step."""
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.has_work() or engine.blocks.num_free < engine.blocks.num_blocks:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def body_for(i: int) -> tuple[str, dict]:
    """Request i of a mixed set: chat or completions, streamed or not, different budgets."""
    if i % 2:
        return "/v1/completions", {"prompt": QUESTIONS[i % 8] * (1 + i % 3), "max_tokens": 4 + i % 13,
                                   "ignore_eos": True, "stream": i % 4 == 1}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTIONS[i % 8]}],
                                    "max_tokens": 6 + i % 11, "ignore_eos": True, "stream": i % 4 == 0}


def text_of(path: str, body: dict, response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    if body.get("stream"):
        events = [e for e in (line[6:] for line in response.text.splitlines() if line.startswith("data: "))]
        assert events[-1] == "[DONE]"
        chunks = [httpx.Response(200, content=e).json() for e in events[:-1]]
        key = "content" if path.endswith("chat/completions") else None
        return "".join((c["choices"][0]["delta"].get(key, "") if key else c["choices"][0]["text"])
                       for c in chunks if c["choices"])
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_32_concurrent_requests_equal_their_sequential_answers(cb_engine):
    app = server.make_app(cb_engine)
    requests = [body_for(i) for i in range(32)]

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            sequential = [text_of(p, b, await client.post(p, json=b)) for p, b in requests]
            cb_engine.recent_batches.clear()
            responses = await asyncio.gather(*(client.post(p, json=b) for p, b in requests))
            return sequential, [text_of(p, b, r) for (p, b), r in zip(requests, responses)]

    sequential, concurrent = asyncio.run(scenario())
    assert concurrent == sequential
    assert max(cb_engine.recent_batches) > 1, "the concurrent requests never shared a step"
    wait_until_idle(cb_engine)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_frees_all_its_blocks(cb_engine, stream):
    app = server.make_app(cb_engine)
    body = {"prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True, "stream": stream}

    async def scenario():
        if stream:
            sent = await asgi_request(app, body, hang_up_after=3)
            assert sent[0]["status"] == 200
        else:
            await asgi_request(app, body, hang_up_after=None, hang_up_after_s=0.3)

    seen = []

    def paced(work, events):   # 5 ms a step: 400 tokens take 2 s, so the hang-up at 0.3 s comes first
        seen.extend(r for r, _ in events)
        time.sleep(0.005)

    cb_engine.on_step = paced
    aborted = cb_engine.stats()["aborted"]
    try:
        asyncio.run(scenario())
        wait_until_idle(cb_engine)   # raises if the request still holds blocks or sits in a queue
    finally:
        cb_engine.on_step = None
    assert cb_engine._by_id == {}
    request = seen[-1]
    assert 0 < len(request.new_ids) < 400, "the request ran on after its client left"
    with TestClient(app) as client:   # a client-closed request (499), with the tokens it did generate
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for fam in text_string_to_metric_families(client.get("/metrics").text) for s in fam.samples}
    assert values[("llm_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))] == 1
    # counted when the stream closed: the step then running may have added one more
    assert len(request.new_ids) - 1 <= values[("llm_generation_tokens_total", ())] <= len(request.new_ids)
    assert cb_engine.stats()["aborted"] == aborted + 1            # the engine counts what it stopped,
    assert values[("llm_requests_aborted_total", ())] == aborted + 1   # and Prometheus reads the count
    assert values[("llm_prompt_tokens_total", ())] == request.n_prompt


def test_200_requests_leave_no_blocks_and_no_requests_behind(cb_engine):
    with TestClient(server.make_app(cb_engine)) as client:
        for i in range(200):
            path, body = body_for(i)
            body = {**body, "max_tokens": 1 + i % 4}
            assert client.post(path, json=body).status_code == 200
    wait_until_idle(cb_engine)
    assert cb_engine._by_id == {} and not cb_engine._inbox and not cb_engine._aborts
    # The loop thread's frame may still hold the step it just finished (one request here,
    # the requests were sequential), and a worker thread may still be letting go of the last
    # one. Once in a full-suite run a second, early request was still referenced (holder not
    # found); a leak would keep a share of the 200, so the bound stays far below that.
    for _ in range(50):
        gc.collect()
        alive = [o for o in gc.get_objects() if type(o) is Request]
        if len(alive) <= 1:
            break
        time.sleep(0.1)
    holders = [type(h).__name__ for r in alive for h in gc.get_referrers(r)]
    assert len(alive) <= 3, f"{len(alive)} finished requests are still referenced, by {holders}"


def test_bad_input_is_refused_before_the_scheduler(cb_engine):
    with TestClient(server.make_app(cb_engine)) as client:
        too_long = client.post("/v1/completions", json={"prompt": "word " * 600, "max_tokens": 8})
        assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
        streamed = client.post("/v1/completions", json={"prompt": "word " * 600, "max_tokens": 8, "stream": True})
        assert streamed.status_code == 400
        hot = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "temperature": -1})
        assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"
        batch = client.post("/v1/completions", json={"prompt": ["Hi", "word " * 600], "max_tokens": 4})
        assert batch.status_code == 400
    assert not cb_engine.scheduler.has_work() and cb_engine.blocks.num_free == cb_engine.blocks.num_blocks


def test_a_list_of_prompts_runs_together_and_equals_one_by_one(cb_engine):
    prompts = QUESTIONS[:5]
    with TestClient(server.make_app(cb_engine)) as client:
        alone = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 8}).json()["choices"][0]["text"]
                 for p in prompts]
        together = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 8}).json()
    assert [c["text"] for c in together["choices"]] == alone
    assert [c["index"] for c in together["choices"]] == list(range(5))


def test_max_waiting_bounds_the_schedulers_queue(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20,
                 max_num_seqs=1, max_num_batched_tokens=64)
    ops = server_ops.ServerOps(max_waiting=1)
    busy = [engine.submit("A long one.", 300, engine_lib.SamplingParams(ignore_eos=True)) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while engine.stats()["waiting"] < 1:   # one runs (max_num_seqs=1), the others wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with TestClient(server.make_app(engine, ops=ops)) as client:
            refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            stats = client.get("/engine/stats").json()
            assert stats["waiting"] >= 1 and stats["running"] == 1
    finally:
        for stream in busy:
            stream.close()
    wait_until_idle(engine)
    engine.close()


def test_a_list_counts_against_max_waiting_and_leaves_nothing_behind(tiny_model_dir):
    """A list is admitted whole: all of its prompts count against the scheduler's queue."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20,
                 max_num_seqs=1, max_num_batched_tokens=64)
    with TestClient(server.make_app(engine, ops=server_ops.ServerOps(max_waiting=1))) as client:
        refused = client.post("/v1/completions", json={"prompt": ["Hi", "Hello", "Hey"], "max_tokens": 2})
        assert refused.status_code == 503
        wait_until_idle(engine)
        ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
    wait_until_idle(engine)
    engine.close()


def test_each_prompt_of_a_list_gets_its_own_default_budget(cb_engine):
    long = "word " * 450
    left = cb_engine.context_length - len(cb_engine.tokenizer(long).input_ids)
    with TestClient(server.make_app(cb_engine)) as client:
        body = client.post("/v1/completions", json={"prompt": ["Hi", long], "ignore_eos": True}).json()
    assert [m["output_tokens"] for m in body["metrics"]] == [128, left]
    wait_until_idle(cb_engine)


def test_engine_flags_reach_the_engine_and_are_refused_by_others(tiny_model_dir):
    args = server.arguments().parse_args(["--kv-memory", "2MB", "--max-num-seqs", "4", "--prefix-caching"])
    options = cli.engine_options(args)
    assert options == {"kv_memory": 2 << 20, "max_num_seqs": 4, "prefix_caching": True}
    engine = load_engine("minivllm:LLM", str(tiny_model_dir), device="cpu", **options)
    assert engine.scheduler.max_num_seqs == 4 and engine.blocks.num_blocks == (2 << 20) // (512 * 16)
    assert type(engine.blocks).__name__ == "PrefixCachingBlockManager"
    engine.close()
    with pytest.raises(ValueError, match="does not take kv_memory"):
        load_engine("04_engine:BaselineEngine", str(tiny_model_dir), device="cpu", kv_memory=1 << 20)


@pytest.mark.real_model
def test_the_real_server_batches_concurrent_openai_clients(default_model_dir, real_engine):
    """A real uvicorn process with the continuous-batching engine; the official client, 8 at once."""
    openai = pytest.importorskip("openai")
    questions = QUESTIONS
    expected = [real_engine.generate(render_chat(real_engine.tokenizer, [{"role": "user", "content": q}]), 12).text
                for q in questions]
    with launcher.serve_in_subprocess(model=str(default_model_dir), engine="minivllm:LLM",
                                    device="cpu", args=("--kv-memory", "64MB")) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")

        async def ask(i: int, q: str) -> str:
            messages = [{"role": "user", "content": q}]
            if i % 2:
                stream = await client.chat.completions.create(model=str(default_model_dir), messages=messages,
                                                              max_tokens=12, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            reply = await client.chat.completions.create(messages=messages, max_tokens=12, model=str(default_model_dir))
            return reply.choices[0].message.content

        async def everyone():
            try:
                return await asyncio.gather(*(ask(i, q) for i, q in enumerate(questions)))
            finally:
                await client.close()

        answers = asyncio.run(everyone())
        stats = httpx.get(f"{url}/engine/stats").json()
    assert answers == expected
    assert max(stats["batch_sizes"]) > 1 and stats["kv_blocks_used"] == 0


def test_a_burst_that_fits_seats_and_max_waiting_is_all_admitted(tiny_model_dir):
    """8 seats + --max-waiting 8: 16 requests at once all fit, though most are still on their way
    into the scheduler (handed over, prefilled a chunk at a time) when the last ones arrive."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20,
                 max_num_seqs=8, max_num_batched_tokens=64)
    app = server.make_app(engine, ops=server_ops.ServerOps(max_waiting=8))

    async def burst(n: int) -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            body = {"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 8}
            return [r.status_code for r in await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                                                  for _ in range(n)))]
    try:
        assert asyncio.run(burst(16)) == [200] * 16
        wait_until_idle(engine)
        assert asyncio.run(burst(17)).count(503) <= 1
    finally:
        wait_until_idle(engine)
        engine.close()


def test_without_max_tokens_a_small_pool_still_answers_a_short_prompt(tiny_model_dir):
    """The default budget (128, or what the context leaves) is clamped to what the KV pool holds:
    a one-word chat on a 4-block pool is answered, not refused for a budget nobody asked for."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=4 * 16 * 2 * 4 * 2 * 16,
                 block_size=16)
    try:
        capacity = engine.token_capacity
        assert capacity < 128 and capacity == engine.blocks.num_blocks * 16
        with TestClient(server.make_app(engine)) as client:
            r = client.post("/v1/completions", json={"prompt": "Hi", "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert 0 < r.json()["usage"]["completion_tokens"] <= capacity - r.json()["usage"]["prompt_tokens"]
    finally:
        engine.close()


def test_cache_salt_keeps_one_clients_prompt_out_of_anothers_cached_tokens(tiny_model_dir):
    """Without a shared salt, cached_tokens cannot tell client B what client A sent."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, block_size=16,
                 prefix_caching=True)
    memo = "The meeting moved to Thursday at 3 pm in room 4B; bring the signed budget forms. " * 3
    try:
        with TestClient(server.make_app(engine)) as client:
            def cached(salt):
                body = {"prompt": memo, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

            assert cached("tenant-a") == 0
            assert cached("tenant-b") == 0 and cached(None) == 0     # another salt, or none: nothing shared
            assert cached("tenant-a") > 0                             # the same salt: A's blocks again
            for bad in (12345, "", "x" * 257):
                r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    finally:
        engine.close()
