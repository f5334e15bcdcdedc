"""Chapter 11 through the server: response_format, guided_*, tools, and the official client's parse()."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient

from conftest import load_script
from kit.engines import load_engine

openai = pytest.importorskip("openai")
server = load_script("05_server")

HELLO = [{"role": "user", "content": "Tell me about a person."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["04_engine:BaselineEngine", "minivllm:LLM"],
                ids=["hf", "batching"])
def http(request, tiny_model_dir):
    engine = load_engine(request.param, str(tiny_model_dir), device="cpu")
    with TestClient(server.make_app(engine, model_name="tiny")) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def chat(http, **body):
    response = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 120, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_response_format_json_schema_and_json_object(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for extra in ({}, {"temperature": 1.0, "seed": 4}):
        choice = chat(http, response_format=fmt, **extra)
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    choice = chat(http, response_format={"type": "json_object"}, max_tokens=200, temperature=1.0, seed=1, top_k=2)
    assert choice["finish_reason"] == "length" or isinstance(json.loads(choice["message"]["content"]), dict)
    assert chat(http, response_format={"type": "text"}, max_tokens=4)["finish_reason"] == "length"


def test_concurrent_free_requests_keep_their_solo_answers(http):
    """Constrained and free requests at once (the batching engine runs them in the same steps)."""
    from concurrent.futures import ThreadPoolExecutor

    free = [{"prompt": p, "max_tokens": 16} for p in ("Once upon a time", "The sky is", "def main():")]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    forced = [{"prompt": p, "max_tokens": 120, "response_format": fmt, "temperature": 1.0, "seed": i}
              for i, p in enumerate(("JSON:", "A person:", "{"))]

    def text(body):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    alone = [text(b) for b in free]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(text, free + forced))
    assert together[:3] == alone
    for answer in together[3:]:
        jsonschema.validate(json.loads(answer), PERSON)


def test_guided_fields_on_completions(http):
    def complete(**body):
        response = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 80, **body})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    assert complete(guided_choice=["yes", "no"]) in ("yes", "no")
    assert complete(guided_regex="[A-Z][a-z]{2,5}") .isalpha()
    assert complete(guided_grammar='root ::= "up" | "down"') in ("up", "down")
    jsonschema.validate(json.loads(complete(guided_json=PERSON)), PERSON)
    jsonschema.validate(json.loads(complete(guided_json=json.dumps(PERSON))), PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    jsonschema.validate(json.loads(complete(response_format=fmt)), PERSON)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_validate_against_the_function_schema(client, tool_choice):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                           max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in (("get_weather",) if isinstance(tool_choice, dict) else ("get_weather", "get_time"))
    schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice=tool_choice, max_tokens=120, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tool_choice_none_never_calls_and_auto_answers_either_way(client, http):
    for _ in range(2):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                               max_tokens=40)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason != "tool_calls"
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=60,
                                               temperature=1.0, seed=seed)
        message = reply.choices[0].message
        if message.tool_calls:
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
        else:
            assert "<tool_call>" not in (message.content or "") or reply.choices[0].finish_reason == "length"


def test_a_tool_result_goes_back_into_the_conversation(client, http):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120)
    call = reply.choices[0].message.tool_calls[0]
    follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    answer = client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    bad = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_openai_parse_returns_a_pydantic_object(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    reply = parse(model="tiny", messages=HELLO, response_format=Person, max_tokens=120)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


BAD = [
    ("a schema that does not compile", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("json_schema without a schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("an unknown response_format type", {"response_format": {"type": "xml"}}, "response_format"),
    ("a schema too deep", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads('{"a":' * 20 + "{}" + "}" * 20)}}}, "response_format"),
    ("a schema too long", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 40_000}}}}, "response_format"),
    ("tools with an invalid schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ("a tool without a function", {"tools": [{"type": "function"}]}, "tools"),
    ("a bad function name", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ("tool_choice naming a missing function", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ("an unknown tool_choice", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("two constraints", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("a bad regex", {"guided_regex": "a("}, "guided_regex"),
    *[(f"a schema with {keyword}", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": schema}, "required": ["a"]}}}}, "response_format")
      for keyword, schema in [("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
                              ("allOf", {"allOf": [{"type": "string"}, {"type": "integer"}]}),
                              ("not", {"not": {"type": "string"}}),
                              ("if/then", {"type": "integer", "if": {"minimum": 1}, "then": {"maximum": 3}}),
                              ("patternProperties", {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}),
                              ("open keys", {"type": "object", "additionalProperties": True}),
                              ("a remote $ref", {"$ref": "http://example.com/x.json"}),
                              ("an unknown format", {"type": "string", "format": "phone"})]],
    ("a tool whose parameters are not an object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ("two tools with one name", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("a tool schema with uniqueItems", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]}, "tools"),
    ("an empty guided_choice", {"guided_choice": []}, "guided_choice"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_structured_requests_are_400s_naming_the_field(http, name, body, param):
    response = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_tools_on_completions_are_refused(http):
    response = http.post("/v1/completions", json={"prompt": "hi", "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_a_stream_holds_back_what_may_be_a_call():
    from kit import structured_api as sa

    hold = sa.HoldBack()
    sent = [hold.feed(p) for p in ("Let me ", "check. <to", "ol_call>", '{"name": "f", "arguments": {"a": 1}}', "</tool_call>")]
    assert "".join(sent) == "Let me check. " and sent[1] == "check. "
    content, call = sa.parse_tool_call(hold.text)
    assert content == "Let me check." and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    plain = sa.HoldBack()
    assert plain.feed("a <b") == "a <b" and plain.feed(" <") == " " and plain.rest() == "<"
    assert sa.parse_tool_call("<tool_call>{not json}</tool_call>") is None
    assert sa.parse_tool_call('<tool_call>{"name": "f", "arguments": {}') is None   # cut off by the budget


def test_a_refused_keyword_is_named_with_where_it_is(http):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    response = http.post("/v1/chat/completions", json={"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "schema.properties.tags.uniqueItems" in message and "not supported" in message


def test_schema_check_allows_annotations_and_enforced_keywords_only():
    from minivllm.structured import FORMATS, check_schema

    def grammar(name):
        return str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": name})))

    unknown = grammar("no-such-format")   # what xgrammar makes of a name it does not know: any string
    for name in FORMATS:                  # each known one it turns into rules of its own
        assert grammar(name) != unknown, name
        check_schema({"type": "string", "format": name})

    check_schema({"title": "t", "description": "d", "type": "object", "$defs": {"p": {"type": "integer"}},
                  "properties": {"a": {"$ref": "#/$defs/p", "default": 1}, "b": {"anyOf": [{"type": "string"}, True]}},
                  "additionalProperties": False, "required": ["a"]})
    for bad, where in [({"oneOf": [True]}, "schema.oneOf"), ({"items": {"contains": {}}}, "schema.items.contains"),
                       ({"anyOf": [{"dependentRequired": {}}]}, "schema.anyOf[0].dependentRequired"),
                       ({"maxItem": 3}, "schema.maxItem"),
                       ({"properties": {"a": {"type": "string", "format": "iban"}}}, "schema.properties.a.format")]:
        with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]").replace("$", r"\$")):
            check_schema(bad)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_short_is_not_sent_as_content(http, stream):
    """tool_choice 'required' with a budget too small for the call: the reply says 'length' and
    carries neither the half-written tag as text nor a call."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 3, "stream": stream}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {") and '"choices": [{' in line]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        text, calls, finish = choice["message"]["content"] or "", choice["message"].get("tool_calls"), choice["finish_reason"]
    assert finish == "length" and not calls
    assert "<" not in text and "tool_call" not in text
