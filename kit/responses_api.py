"""kit/responses_api.py - OpenAI's /v1/responses, for text in and out, over the chat route.

The official `openai` package now steers new code to `client.responses.create(...)`. For text
it is chat completions in another shape: `input` (a string, or messages) and `instructions`
(a system message) become the conversation, `max_output_tokens` the budget, `text.format`
the response_format; the answer is a Response whose `output` holds one message of
`output_text`, and a stream is typed events (`response.output_text.delta`, ...) instead of chat
chunks. So this route builds a ChatRequest, lets the chat endpoint do every check and the work,
and reshapes what comes back. Nothing is stored here: `store: true` and `previous_response_id`
(both ask the server to keep conversations) are refused, as is any field not read below.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field, ValidationError

from kit.openai_api import APIError, ChatRequest, _Strict
from minivllm.contracts import REQUEST_FIELDS

# Fields of the Responses API that change nothing for text in and out: any value (ANY), or these values.
ANY = object()
HARMLESS = {"metadata": ANY, "user": ANY, "service_tier": ANY, "safety_identifier": ANY, "prompt_cache_key": ANY,
            "parallel_tool_calls": ANY, "stream_options": ANY, "truncation": (None, "disabled"),
            "tool_choice": (None, "auto", "none"), "tools": (None, []), "include": (None, []),
            "reasoning": (None,), "top_logprobs": (None, 0), "background": (None, False)}
STATELESS = "this server keeps no conversations: send the whole conversation as input instead"


class InputPart(_Strict):
    type: str                                 # input_text / output_text; others are refused by name
    text: str | None = None


class InputMessage(_Strict):
    type: str = "message"
    role: str
    content: str | list[InputPart]


class TextFormat(_Strict):
    type: str                                 # text, json_object or json_schema
    name: str = Field("response", max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")   # extras checked below
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None      # bounded as chat's max_completion_tokens
    temperature: float | None = None          # bounded as chat's; null: the server's default, greedy
    top_p: float | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None


# --8<-- [start:request]
def chat_request(req: ResponsesRequest) -> ChatRequest:
    """The same request as chat completions spells it (the chat route checks the rest)."""
    for name, value in (req.model_extra or {}).items():
        if name not in HARMLESS or not _harmless(value, HARMLESS[name]):
            raise APIError(400, f"{name} is not supported by this server's /v1/responses", param=name)
    if req.store:
        raise APIError(400, f"store: true is not supported: {STATELESS}", param="store")
    if req.previous_response_id is not None:
        raise APIError(400, f"previous_response_id is not supported: {STATELESS}", param="previous_response_id")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        if item.type != "message" or item.role not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"input[{i}]: only messages of text are supported, got {item.type} "
                                f"from {item.role!r}", param="input")
        parts = [item.content] if isinstance(item.content, str) else item.content
        if not isinstance(item.content, str) and any(p.type not in ("input_text", "output_text") or p.text is None
                                                     for p in parts):
            raise APIError(400, f"input[{i}].content: only input_text parts are supported", param="input")
        messages.append({"role": item.role, "content": "".join(p if isinstance(p, str) else p.text for p in parts)})
    if not messages:
        raise APIError(400, "input must hold at least one message", param="input")
    body = {"model": req.model, "messages": messages, "stream": req.stream,
            "max_completion_tokens": req.max_output_tokens,
            **({"temperature": req.temperature} if req.temperature is not None else {}),
            **({"top_p": req.top_p} if req.top_p is not None else {}),
            **({"stream_options": {"include_usage": True}} if req.stream else {})}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        if fmt.type not in ("json_object", "json_schema"):
            raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {fmt.type!r}",
                           param="text")
        body["response_format"] = {"type": fmt.type, **({"json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                                          "strict": fmt.strict}}
                                                         if fmt.type == "json_schema" else {})}
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:   # in the Responses API's names, and the library's words for a bound
        err = exc.errors()[0]
        name = RENAMED.get(str(err["loc"][0]), str(err["loc"][0])) if err.get("loc") else "body"
        spec = next((s for s in REQUEST_FIELDS.values() if str(err["loc"][0]) in (s.name, s.openai)), None)
        message = spec.refusal(err["input"], name) if spec is not None and err["type"] in BOUNDS else \
            f"{name}: {err['msg'].removeprefix('Value error, ')}"
        raise APIError(400, message, param=name) from None


RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}
BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _harmless(value, allowed) -> bool:
    return allowed is ANY or any(type(value) is type(a) and value == a for a in allowed)


# --8<-- [end:request]


# --8<-- [start:answer]
def response_object(rid: str, created: int, req: ResponsesRequest, chat: dict | None, text: str,
                    status: str, finish: str | None, usage: dict | None) -> dict:
    """A Response as OpenAI shapes one: one assistant message of output_text."""
    done = status != "in_progress"
    message = {"type": "message", "id": f"msg_{rid[5:]}", "status": "completed" if done else "in_progress",
               "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                 "logprobs": []}] if done else []}
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "error": None, "model": (chat or {}).get("model", req.model), "instructions": req.instructions,
            "output": [message] if done else [], "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None, "store": False, "text": {"format": fmt}, "truncation": "disabled",
            "metadata": (req.model_extra or {}).get("metadata") or {}, "usage": usage and {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": 0}}}


async def events(rid: str, created: int, req: ResponsesRequest, chunks: AsyncIterator) -> AsyncIterator[str]:
    """Chat's streamed chunks as the Responses API's typed events."""
    seq, text, finish, usage, model = 0, "", None, None, req.model
    ids = {"item_id": f"msg_{rid[5:]}", "output_index": 0, "content_index": 0}

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    start = response_object(rid, created, req, None, "", "in_progress", None, None)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    item = {"type": "message", "id": ids["item_id"], "status": "in_progress", "role": "assistant", "content": []}
    yield event("response.output_item.added", output_index=0, item=item)
    yield event("response.content_part.added", **ids, part={"type": "output_text", "text": "", "annotations": []})
    async for raw in chunks:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:   # too late for a status code: the stream says it failed
                failed = {**start, "status": "failed", "error": {"code": str(chunk["error"].get("code")),
                                                                  "message": chunk["error"]["message"]}}
                yield event("response.failed", response=failed)
                return
            model, usage = chunk.get("model", model), chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
                if delta:
                    text += delta
                    yield event("response.output_text.delta", **ids, delta=delta, logprobs=[])
    yield event("response.output_text.done", **ids, text=text, logprobs=[])
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    yield event("response.content_part.done", **ids, part=part)
    final = response_object(rid, created, req, {"model": model}, text,
                            "incomplete" if finish == "length" else "completed", finish, usage)
    yield event("response.output_item.done", output_index=0, item=final["output"][0])
    yield event("response.incomplete" if finish == "length" else "response.completed", response=final)
# --8<-- [end:answer]


def install(app: FastAPI, chat_endpoint) -> None:
    """POST /v1/responses, answered by the chat endpoint (05_server's OpenAIServer.chat_completions)."""
    async def responses(req: ResponsesRequest, request: Request):
        chat = chat_request(req)
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        answer = await chat_endpoint(chat, request)
        if not req.stream:
            choice = answer["choices"][0]
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            return response_object(rid, created, req, answer, choice["message"]["content"] or "", status,
                                   choice["finish_reason"], answer["usage"])
        return StreamingResponse(events(rid, created, req, answer.body_iterator), media_type="text/event-stream",
                                 background=answer.background)
    app.post("/v1/responses")(responses)
