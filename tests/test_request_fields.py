"""One table of request fields: SamplingParams and the server's request models bound each field
the same way, enforce each bound, and say the same words when they refuse."""

from __future__ import annotations

import dataclasses
import json
import math

import annotated_types as at
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from kit import openai_api as api
from minivllm.contracts import REQUEST_FIELDS, SamplingParams

MODELS = (api.ChatRequest, api.CompletionRequest)
BODY = {api.ChatRequest: {"messages": [{"role": "user", "content": "hi"}]}, api.CompletionRequest: {"prompt": "hi"}}
NUMERIC = [spec for spec in REQUEST_FIELDS.values() if spec.low is not None or spec.high is not None]
SIZED = [spec for spec in REQUEST_FIELDS.values() if spec.max_items is not None or spec.max_chars is not None]


# Completions' max_tokens also takes 0, which scores the prompt with echo (kit/scoring_api.py):
# its low bound is the one place a request model differs from the table, tested there.
SCORING_ZERO = {(api.CompletionRequest, "max_tokens")}


def wire_names(model, spec) -> list[str]:
    """The request model's fields that carry spec's value: its own name and OpenAI's (chat's
    `logprobs` is only the switch; `top_logprobs` carries the number)."""
    return [n for n in (spec.name, spec.openai) if n in model.model_fields
            and model.model_fields[n].annotation != (bool | None) and (model, n) not in SCORING_ZERO]


def expected_metadata(spec) -> dict:
    """The pydantic constraints the table asks for, read off the record itself."""
    out = {}
    if spec.low is not None:
        out["gt" if spec.low_open else "ge"] = spec.low
    if spec.high is not None:
        out["lt" if spec.high_open else "le"] = spec.high
    if spec.max_chars is not None and spec.max_items is None:
        out.update(min_length=1, max_length=spec.max_chars)
    return out


CONSTRAINTS = {at.Ge: "ge", at.Gt: "gt", at.Le: "le", at.Lt: "lt", at.MinLen: "min_length", at.MaxLen: "max_length"}


def metadata(model, name: str) -> dict:
    """A pydantic field's constraints (annotated_types' Ge, Le, Gt, Lt, MinLen, MaxLen) as {"ge": 1, ...}."""
    return {CONSTRAINTS[type(m)]: getattr(m, CONSTRAINTS[type(m)]) for m in model.model_fields[name].metadata}


def edges(spec) -> list[tuple[str, object, bool]]:
    """(which end, value, allowed?) just inside and just outside each bound the field has."""
    def step(x, up: bool):
        if isinstance(x, int):
            return x + 1 if up else x - 1
        return math.nextafter(x, math.inf if up else -math.inf)
    out = []
    if spec.low is not None:
        inside = step(spec.low, up=True) if spec.low_open else spec.low
        outside = spec.low if spec.low_open else step(spec.low, up=False)
        out += [("low", inside, True), ("low", outside, False)]
    if spec.high is not None:
        inside = step(spec.high, up=False) if spec.high_open else spec.high
        outside = spec.high if spec.high_open else step(spec.high, up=True)
        out += [("high", inside, True), ("high", outside, False)]
    return out


NUMERIC_CASES = [(spec, end, value, ok) for spec in NUMERIC for end, value, ok in edges(spec)]


def validate(model, name: str, value):
    body = {**BODY[model], name: value}
    if model is api.ChatRequest and name == "top_logprobs":
        body["logprobs"] = True
    return model.model_validate_json(json.dumps(body))   # through JSON, as the server reads a body


def test_every_field_is_in_the_table_with_its_help():
    assert list(REQUEST_FIELDS) == [f.name for f in dataclasses.fields(SamplingParams)]
    for spec in REQUEST_FIELDS.values():
        assert spec.help and spec.default == getattr(SamplingParams(), spec.name)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_request_models_bound_each_field_as_the_table_does(model):
    for spec in NUMERIC + [s for s in SIZED if s.max_items is None]:
        names = wire_names(model, spec)
        assert names or (model, spec.name) in SCORING_ZERO, f"{spec.name} is bounded in SamplingParams but not on {model.__name__}"
        for name in names:
            assert metadata(model, name) == expected_metadata(spec), f"{model.__name__}.{name}"


@pytest.mark.parametrize("spec,end,value,ok", NUMERIC_CASES,
                         ids=[f"{s.name}-{end}-{'in' if ok else 'out'}" for s, end, _, ok in NUMERIC_CASES])
def test_each_numeric_bound_is_enforced_on_both_sides(spec, end, value, ok):
    if ok:
        assert getattr(SamplingParams(**{spec.name: value}), spec.name) == value
    else:
        with pytest.raises(ValueError, match=f"^{spec.name} must be") as refused:
            SamplingParams(**{spec.name: value})
        assert str(refused.value) == spec.refusal(value)
    for model in MODELS:
        for name in wire_names(model, spec):
            if ok:
                assert getattr(validate(model, name, value), name) == value
            else:
                with pytest.raises(ValidationError) as refused:
                    validate(model, name, value)
                assert refused.value.errors()[0]["loc"] == (name,)


def sized_value(spec, items: int, chars: int):
    """A value for a sized field: `items` entries (a list's), each a text of `chars` characters."""
    if spec.name == "logit_bias":
        return {token: 1.0 for token in range(items)}
    if spec.name == "stop_token_ids":
        return list(range(items))
    text = "x" * chars
    return [text] * items if spec.max_items is not None else text


def sized_edges(spec) -> list[tuple[object, bool]]:
    out = []
    if spec.max_items is not None:
        out += [(sized_value(spec, spec.max_items, 1), True), (sized_value(spec, spec.max_items + 1, 1), False)]
    if spec.max_chars is not None:
        out += [(sized_value(spec, 1, spec.max_chars), True), (sized_value(spec, 1, spec.max_chars + 1), False),
                (sized_value(spec, 1, 0), False)]
    return out


SIZED_CASES = [(spec, value, ok) for spec in SIZED for value, ok in sized_edges(spec)]


@pytest.mark.parametrize("spec,value,ok", SIZED_CASES,
                         ids=[f"{s.name}-{i}-{'in' if ok else 'out'}" for i, (s, _, ok) in enumerate(SIZED_CASES)])
def test_each_size_bound_is_enforced_by_the_library_and_the_server(spec, value, ok):
    """A list's sizes are SamplingParams' to check (the server's 400 comes from its ValueError);
    a single string's the request model checks too."""
    if ok:
        SamplingParams(**{spec.name: value})
    else:
        with pytest.raises(ValueError, match=f"^{spec.name} "):
            SamplingParams(**{spec.name: value})
    wire = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    try:
        req = api.CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", spec.name: wire}))
        api.sampling_params(req, SamplingParams)
    except ValidationError as exc:
        assert not ok and exc.errors()[0]["loc"] == (spec.name,)
    except api.APIError as exc:
        assert not ok and exc.status == 400 and exc.param == spec.name
    else:
        assert ok, f"{spec.name}: {value!r:.60} was accepted by the server"


@pytest.fixture(scope="module")
def wire():
    """The request models behind the server's error handlers, with no engine at all."""
    app = FastAPI()
    api.install_error_handlers(app)

    @app.post("/v1/chat/completions")
    def chat(req: api.ChatRequest) -> dict:
        return {}

    @app.post("/v1/completions")
    def completions(req: api.CompletionRequest) -> dict:
        return {}
    return TestClient(app)


@pytest.mark.parametrize("spec,end,value", [(s, e, v) for s, e, v, ok in NUMERIC_CASES if not ok],
                         ids=[f"{s.name}-{e}" for s, e, _, ok in NUMERIC_CASES if not ok])
def test_the_server_refuses_in_the_librarys_words(wire, spec, end, value):
    for model, path in ((api.ChatRequest, "/v1/chat/completions"), (api.CompletionRequest, "/v1/completions")):
        for name in wire_names(model, spec):
            body = {**BODY[model], name: value, **({"logprobs": True} if name == "top_logprobs" else {})}
            resp = wire.post(path, json=body)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == name and error["message"] == spec.refusal(value, name)


def test_no_field_of_the_table_is_silently_ignored():
    declared = {name for model in MODELS for name in model.model_fields}
    for spec in REQUEST_FIELDS.values():   # each reachable under its own name or OpenAI's
        assert {spec.name, spec.openai} & declared, f"no request field sets SamplingParams.{spec.name}"
    # A refused field that a model declares would be honoured, never refused: the two disagree.
    assert not set(api.UNSUPPORTED) & declared
    assert not set(api.MESSAGE_UNSUPPORTED) & set(api.ChatMessage.model_fields)
    # Chat's names for a field (top_logprobs, max_completion_tokens) sent to completions are refused.
    for spec in REQUEST_FIELDS.values():
        for name in {spec.name, spec.openai} & set(api.ChatRequest.model_fields):
            if name in api.CompletionRequest.model_fields:
                continue
            req = api.CompletionRequest.model_validate({"prompt": "hi", name: 2})
            with pytest.raises(api.APIError) as refused:
                api.check_request(req, "served")
            assert refused.value.status == 400 and refused.value.param == name
