"""Scoring a prompt: SamplingParams.prompt_logprobs in the library, echo / max_tokens 0 / prompt_logprobs
in the server, each prompt token's log-probability equal to HF float32's on the same tokens, under
prefix caching and chunked prefill, and lm-evaluation-harness's local-completions request shapes."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import load_script
from minivllm import LLM, SamplingParams
from minivllm import prompt_logprobs as scoring

server = load_script("05_server")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "Question: what is the capital of France? Answer: Paris is the capital of France."
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def score(ids: list[int]) -> list[float]:
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    return score


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB", enable_prefix_caching=True,
             max_num_batched_tokens=8, max_num_seqs=4) as llm:   # chunks of 8: the prompt spans several
        yield llm


def test_library_prompt_logprobs_equal_hf_under_chunks_and_prefix_caching(engine, hf_logprobs):
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=4))      # caches the prompt's blocks
    scored = engine.generate(PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=2))
    ids = scored.prompt_token_ids
    assert len(ids) > 16 and scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    got = [e.logprob for e in scored.prompt_logprobs[1:]]
    assert max(abs(a - b) for a, b in zip(got, hf_logprobs(ids))) < TOL
    assert [e.token_id for e in scored.prompt_logprobs[1:]] == ids[1:]
    assert all(len(e.top) == 2 and e.top[0][1] >= e.top[1][1] for e in scored.prompt_logprobs[1:])
    assert scored.output_ids == plain.output_ids and plain.prompt_logprobs is None   # greedy unchanged
    again = engine.generate(PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=0))  # nothing shared, all computed
    assert [e.logprob for e in again.prompt_logprobs[1:]] == pytest.approx(got, abs=TOL)
    batch = engine.generate([PROMPT, "Hello there, friend"], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert [e.logprob for e in batch[0].prompt_logprobs[1:]] == pytest.approx(got, abs=TOL)
    assert [e.logprob for e in batch[1].prompt_logprobs[1:]] == pytest.approx(
        hf_logprobs(batch[1].prompt_token_ids), abs=TOL)


def test_speculative_decoding_scores_the_same(tiny_model_dir, hf_logprobs):
    with LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB", speculative="ngram",
             max_num_batched_tokens=8, max_num_seqs=4) as llm:
        plain = llm.generate(PROMPT, SamplingParams(max_tokens=6))
        scored = llm.generate(PROMPT, SamplingParams(max_tokens=6, prompt_logprobs=1))
    assert scored.output_ids == plain.output_ids
    assert [e.logprob for e in scored.prompt_logprobs[1:]] == pytest.approx(hf_logprobs(scored.prompt_token_ids),
                                                                            abs=TOL)


def test_library_refuses_bad_prompt_logprobs():
    for bad in (-1, 21, "2", 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_no_full_vocab_rows_unless_asked(engine, monkeypatch):
    seen = []
    forward = type(engine.runner).forward
    monkeypatch.setattr(type(engine.runner), "forward",
                        lambda self, *a, **k: seen.append(a[4] if len(a) > 4 else k.get("num_logits")) or
                        forward(self, *a, **k))
    engine.generate(PROMPT, SamplingParams(max_tokens=3))
    assert seen and all(rows is None for rows in seen)   # one row a request, as before scoring existed
    assert scoring.logit_rows([], [], []) is None


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(server.make_app(engine, model_name="tiny")) as c:
        yield c


def test_echo_with_logprobs_as_lm_eval_sends_it(client, engine, hf_logprobs):
    """lm-evaluation-harness's local-completions loglikelihood request: token ids, echo, one token."""
    ids = engine.tokenizer(PROMPT).input_ids
    body = {"model": "tiny", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True,
            "temperature": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids) + 1 and choice["text"].startswith(engine.tokenizer.decode(ids))
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(hf_logprobs(ids), abs=TOL)
    ctxlen = 5   # what the harness sums: the continuation's tokens, the generated one left out
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(hf_logprobs(ids)[ctxlen - 1:]), abs=1e-3)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:]) and lp["text_offset"][0] == 0


def test_max_tokens_0_with_echo_scores_without_generating(client, engine, hf_logprobs):
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 1}
    out = client.post("/v1/completions", json=body).json()
    choice, ids = out["choices"][0], engine.tokenizer(PROMPT).input_ids
    assert choice["text"] == PROMPT and out["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(hf_logprobs(ids), abs=TOL)
    vllm = choice["prompt_logprobs"]   # vLLM's shape: {token id: {logprob, rank, decoded_token}}
    assert vllm[0] is None and len(vllm) == len(ids)
    first = vllm[1][str(ids[1])]
    assert first["logprob"] == pytest.approx(hf_logprobs(ids)[0], abs=TOL) and "decoded_token" in first


def test_scoring_refusals(client):
    for body, param in (({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "Hi", "max_tokens": -1, "echo": True}, "max_tokens"),
                        ({"prompt": "Hi", "echo": True, "logprobs": 1, "stream": True}, "echo"),
                        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs")):
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, body
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "echo": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"


def test_lm_eval_generation_request_with_more_than_four_stops(client, engine):
    ids = engine.tokenizer("def add(a, b):").input_ids
    body = {"model": "tiny", "prompt": [ids], "max_tokens": 8, "temperature": 0, "seed": 1234,
            "stop": ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|endoftext|>"]}
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_takes_vllms_prompt_logprobs(client):
    out = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 2, "prompt_logprobs": 1}).json()
    assert out["prompt_logprobs"][0] is None and all(len(e) in (1, 2) for e in out["prompt_logprobs"][1:])


def test_an_engine_that_cannot_score_says_so(tiny_engine):
    with TestClient(server.make_app(tiny_engine, model_name="tiny")) as c:
        refused = c.post("/v1/completions", json={"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 1})
    assert refused.status_code == 400 and "minivllm:LLM" in refused.json()["error"]["message"]
