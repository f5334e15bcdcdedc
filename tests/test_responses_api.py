"""/v1/responses through the official `openai` package (client.responses.create): text in and out,
streamed or not, instructions, max_output_tokens, a JSON schema, and the refusals (store, previous_response_id,
unknown fields)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from conftest import load_script
from kit import responses_api
from minivllm import LLM

openai = pytest.importorskip("openai")
server = load_script("05_server")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory="8MB")
    with TestClient(server.make_app(engine, model_name="tiny")) as http:
        http.chat = lambda **body: http.post("/v1/chat/completions", json=body).json()
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), http
    engine.close()


def test_text_in_text_out_equals_chat(client):
    sdk, http = client
    chat = http.chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                     max_tokens=6)
    response = sdk.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=6)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.status in ("completed", "incomplete")
    if chat["choices"][0]["finish_reason"] == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    as_messages = sdk.responses.create(input=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                                       max_output_tokens=6, temperature=0, top_p=1.0)
    assert as_messages.output_text == response.output_text


def test_streamed_events_add_up_to_the_answer(client):
    sdk, _ = client
    plain = sdk.responses.create(input="Say hello", max_output_tokens=8)
    kinds, deltas = [], []
    with sdk.responses.create(input="Say hello", max_output_tokens=8, stream=True) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            final = event
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == plain.output_text == final.response.output_text
    assert final.response.usage.output_tokens == plain.usage.output_tokens


def test_json_schema_format_becomes_chats_response_format():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    req = responses_api.ResponsesRequest.model_validate(
        {"input": "Is water wet?", "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                      "strict": True}}})
    chat = responses_api.chat_request(req)
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert chat.response_format.json_schema.name == "answer" and chat.messages[0].content == "Is water wet?"
    plain = responses_api.chat_request(responses_api.ResponsesRequest.model_validate(
        {"input": "Hi", "text": {"format": {"type": "text"}}}))
    assert plain.response_format is None


def test_refusals_say_why(client):
    sdk, _ = client
    for kwargs, param, words in (({"store": True}, "store", "keeps no conversations"),
                                 ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no conversations"),
                                 ({"extra_body": {"frobnicate": 1}}, "frobnicate", "not supported"),
                                 ({"temperature": 3}, "temperature", "temperature"),
                                 ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
                                 ({"tools": [{"type": "web_search"}]}, "tools", "not supported")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(input="Hi", **kwargs)
        error = refused.value.body
        assert error["param"] == param and words in error["message"] and isinstance(error["code"], str), kwargs
    assert sdk.responses.create(input="Hi", max_output_tokens=2, store=False, metadata={"k": "v"}).output_text is not None
