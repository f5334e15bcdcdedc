"""The server as a vLLM or OpenAI client uses it: vLLM's sampling extras, token-id prompts,
names on messages, more than four stops, GET /v1/models/{id}, OpenAI-shaped errors, vLLM's flags."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from conftest import load_script
from minivllm import LLM

server = load_script("05_server")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB")
    with TestClient(server.make_app(engine, model_name="tiny")) as c:
        c.engine = engine
        yield c
    engine.close()


def complete(client, **body):
    return client.post("/v1/completions", json={"max_tokens": 6, **body})


def test_token_id_prompts_one_or_a_batch(client):
    ids = client.engine.tokenizer("The capital of France is").input_ids
    text = complete(client, prompt="The capital of France is").json()
    one = complete(client, prompt=ids).json()
    assert one["choices"][0]["text"] == text["choices"][0]["text"] and isinstance(one["metrics"], dict)
    batch = complete(client, prompt=[ids, ids[:3]]).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["text"] == text["choices"][0]["text"]
    bad = complete(client, prompt=[10**7])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_vllm_sampling_extras(client):
    free = complete(client, prompt="Hello", max_tokens=8).json()["choices"][0]
    assert complete(client, prompt="Hello", min_p=0.5, temperature=1.0, seed=1).status_code == 200
    held = complete(client, prompt="Hello", max_tokens=8, min_tokens=8, stop=[free["text"][:2] or "x"]).json()
    assert held["choices"][0]["finish_reason"] == "length"
    out = complete(client, prompt="Hello", stop_token_ids=[0], min_tokens=1).json()
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    refused = complete(client, prompt="Hello", min_p=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_p"
    constrained = complete(client, prompt="Yes or no?", structured_outputs={"choice": ["yes", "no"]}).json()
    assert constrained["choices"][0]["text"] in ("yes", "no")
    two = complete(client, prompt="Hi", structured_outputs={"choice": ["a"], "regex": "b"})
    assert two.status_code == 400 and "exactly one of" in two.json()["error"]["message"]


def test_up_to_64_stop_strings(client):
    stops = [f"zz{i}" for i in range(64)]
    assert complete(client, prompt="Hello", stop=stops).status_code == 200
    over = complete(client, prompt="Hello", stop=stops + ["zz64"])
    assert over.status_code == 400 and "at most 64" in over.json()["error"]["message"]


def test_name_on_a_message_goes_to_the_template(client):
    said = client.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi", "name": "alice"}]})
    assert said.status_code == 200, said.text


def test_models_retrieve_and_openai_shaped_errors(client):
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/other").json()["error"]
    assert missing["code"] == "model_not_found"
    unknown = client.get("/v1/nothing-here")
    error = unknown.json()["error"]
    assert unknown.status_code == 404 and error["code"] == "unknown_route" and "/v1/completions" in error["message"]
    bad = complete(client, prompt="Hi", temperature=-1).json()["error"]
    assert isinstance(bad["code"], str)


def test_vllm_flag_names_and_positional_model(monkeypatch):
    parser = server.arguments()
    args = parser.parse_args(["some/model", "--enable-prefix-caching", "--max-model-len", "256",
                              "--quantization", "int8", "--served-model-name", "mine", "--seed", "3"])
    assert (args.model_tag, args.prefix_caching, args.max_model_len, args.quant, args.served_model_name,
            args.seed) == ("some/model", True, 256, "int8", "mine", 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])
