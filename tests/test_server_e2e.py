"""05_server.py as a real process: uvicorn on a loopback port, driven by the `openai` package and httpx."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import REPO_ROOT, load_script
from minivllm.text import render_chat

openai = pytest.importorskip("openai")
launcher = importlib.import_module("kit.launcher")

PROMPTS = ["Tell me about the sea.", "What is 2+2?", "Name a colour.", "Write a haiku.",
           "Who wrote Hamlet?", "Explain gravity.", "Say hello in French.", "List three fruits."]


def running_server(model: str, threads: int | None = None):
    """05_server.py as its own process on a free loopback port (the same launcher the benchmark uses)."""
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    return launcher.serve_in_subprocess(model, device="cpu", startup_timeout_s=180.0, env=env)


@pytest.fixture(scope="module")
def base_url(tiny_model_dir):
    # One thread: a tiny model gains nothing from more, and the test process needs a core too.
    with running_server(str(tiny_model_dir), threads=1) as base:
        yield base


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0, timeout=120)


def served(client) -> str:
    """The id the server answers to: OpenAI clients must name it (another is a 404)."""
    return client.models.list().data[0].id


def ask(base_url: str, prompt: str, **extra) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, **extra}
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def test_openai_client_chat_gives_the_engines_answer(client, tiny_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(model=served(client), messages=messages, max_tokens=16)
    expected = tiny_engine.generate(render_chat(tiny_engine.tokenizer, messages), 16)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.output_ids)


def test_openai_client_stream_equals_the_plain_answer(client):
    kwargs = {"model": served(client), "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 20}
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_openai_client_completions_plain_and_streamed(client, tiny_engine):
    plain = client.completions.create(model=served(client), prompt="The weather today", max_tokens=12)
    assert plain.choices[0].text == tiny_engine.generate("The weather today", 12).text
    streamed = client.completions.create(model=served(client), prompt="The weather today", max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert [m.id for m in client.models.list().data] == [str(tiny_engine.model_name)]


def test_errors_over_http_and_the_server_survives(base_url, client):
    bad = httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json",
                     headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=served(client), max_tokens=8,
                                       messages=[{"role": "user", "content": "word " * 700}])
    assert ask(base_url, "Still there?", max_tokens=2) is not None


def test_openai_client_sees_refusals_of_out_of_range_fields(client):
    hello = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=hello, max_tokens=2)
    for bad in ({"temperature": 3.0}, {"stop": [f"s{i}" for i in range(65)]}, {"seed": 2**70}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=served(client), messages=hello, max_tokens=2, **bad)
    parts = client.chat.completions.create(model=served(client), max_tokens=4, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert parts.choices[0].message.role == "assistant"


def test_openai_client_penalties_and_logit_bias_give_the_engines_answer(client, tiny_engine):
    params_mod = load_script("03_contracts")
    messages = [{"role": "user", "content": "Say something."}]
    prompt = render_chat(tiny_engine.tokenizer, messages)
    settings = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "logit_bias": {"30": 9}}
    reply = client.chat.completions.create(model=served(client), messages=messages, max_tokens=10, **settings,
                                           extra_body={"repetition_penalty": 1.3})
    expected = tiny_engine.generate(prompt, 10, params_mod.SamplingParams(
        presence_penalty=0.5, frequency_penalty=1.5, logit_bias={30: 9}, repetition_penalty=1.3))
    assert reply.choices[0].message.content == expected.text
    forced = client.completions.create(model=served(client), prompt="Hi", max_tokens=3, logit_bias={"30": 100})
    assert forced.choices[0].text == tiny_engine.tokenizer.decode([30]) * 3


def test_openai_client_chat_logprobs_plain_and_streamed(client, tiny_engine):
    params_mod = load_script("03_contracts")
    messages = [{"role": "user", "content": "Name a colour."}]
    kwargs = {"model": served(client), "messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 3}
    plain = client.chat.completions.create(**kwargs)
    expected = tiny_engine.generate(render_chat(tiny_engine.tokenizer, messages), 8, params_mod.SamplingParams(logprobs=3))
    content = plain.choices[0].logprobs.content
    assert [c.token for c in content] == [tiny_engine.tokenizer.decode([t]) for t in expected.output_ids]
    for got, want in zip(content, expected.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4) and len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob >= got.top_logprobs[1].logprob >= got.top_logprobs[2].logprob
        assert got.bytes == list(got.token.encode())
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_openai_client_completion_logprobs_plain_and_streamed(client):
    kwargs = {"model": served(client), "prompt": "The weather today", "max_tokens": 8, "logprobs": 2}
    plain = client.completions.create(**kwargs).choices[0]
    lp = plain.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(len(alternatives) <= 2 and v <= 0 for alternatives, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    chunks = list(client.completions.create(**kwargs, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_openai_client_sees_refusals_of_bad_controls(client):
    hello = [{"role": "user", "content": "Hi"}]
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {"1": 200}},
                {"logit_bias": {"10000000": 1}}, {"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2},
                {"extra_body": {"repetition_penalty": 0}}, {"n": 2},
                {"response_format": {"type": "xml"}},
                {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
                    "type": "function", "function": {"name": "g"}}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=served(client), messages=hello, max_tokens=2, **bad)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.95}], ids=["greedy", "seeded"])
def test_simultaneous_requests_get_their_solo_answers(base_url, sampling):
    extras = [{**sampling, "seed": i} if sampling else {} for i in range(len(PROMPTS))]
    alone = [ask(base_url, p, **e) for p, e in zip(PROMPTS, extras)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda pe: ask(base_url, pe[0], **pe[1]), zip(PROMPTS, extras)))
    assert together == alone


def test_a_client_hanging_up_mid_stream_frees_the_server(base_url):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as resp:
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break   # leaving the block closes the connection mid-generation
    assert all(e["object"] == "text_completion" for e in events)
    assert ask(base_url, "Are you free?", max_tokens=2) is not None


def test_uvicorn_serves_the_factory(tiny_model_dir):
    """`uvicorn --factory 05_server:create_app`, as the README runs it: the engine named by ENGINE_CLASS and ENGINE_MODEL."""
    port = launcher.free_port()
    env = {**os.environ, "ENGINE_CLASS": "04_engine:BaselineEngine", "ENGINE_MODEL": str(tiny_model_dir),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "05_server:create_app", "--port", str(port)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert launcher.wait_until_healthy(url, proc), "uvicorn did not come up"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == str(tiny_model_dir)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_uvicorn_stops_at_start_when_the_model_does_not_load(tmp_path):
    """A model that fails to load stops uvicorn before it serves anything, with the reason; it does
    not start a server whose every request tries the load again."""
    port = launcher.free_port()
    env = {**os.environ, "ENGINE_MODEL": str(tmp_path / "no-such-model"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "uvicorn", "--factory", "05_server:create_app", "--port", str(port)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "does not exist" in run.stderr and "Uvicorn running" not in run.stdout + run.stderr


@pytest.mark.real_model
def test_readme_curl_request_against_smollm2(default_model_dir, tmp_path):
    with running_server(str(default_model_dir)) as base:
        # The README's: curl -s http://127.0.0.1:8001/v1/chat/completions -H 'Content-Type: application/json'
        #   -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32}'
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32})
    assert resp.status_code == 200
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] <= 32 and body["choices"][0]["finish_reason"] in ("stop", "length")
