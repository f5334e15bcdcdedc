"""kit/openai_api.py - OpenAI's HTTP API as data: what a request may say, and how answers and errors look.

05_server.py keeps the serving (admission, the engine's stream, the endpoints); this file
keeps the wire format, which is the same for every engine:

- the request bodies, strict: a wrong type, a non-finite number or an out-of-range value is a
  400 naming the field, and an OpenAI field this server does not implement is refused, not ignored;
- errors in OpenAI's JSON shape, with the right status, for every way a request can fail;
- the mapping from a request's fields to `SamplingParams`;
- the shapes of the answer: replies, log-probabilities, streamed chunks, usage, Server-Sent Events;
- a cap on the request body's size and on the time it may take to arrive, enforced while it arrives;
- the conversation as token ids in which the client's text stays text (`chat_ids`).
"""

from __future__ import annotations

import json
import re
import logging
from collections.abc import Callable
from typing import Annotated, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kit import scoring_api, structured_api
from minivllm import text
from minivllm.contracts import REQUEST_FIELDS
from minivllm.engine_loop import EngineUnavailable
from minivllm.structured import StructuredOutput


log = logging.getLogger("05_server")
MAX_PROMPTS = 64   # prompts in one /v1/completions request: a list is work for many requests
MAX_MESSAGES = 1024   # messages in one conversation: each costs template work before any check
# A token is rarely more than a few characters; a text longer than this many characters per
# token of the context window is refused before the tokenizer (and the chat template) reads it.
MAX_CHARS_PER_TOKEN = 32


# --8<-- [start:request-models]
class _Strict(BaseModel):
    # strict: "0.7" is not a temperature and true is not a token count; unknown fields are ignored.
    # allow_inf_nan=False: Python's JSON reader turns 1e999 and Infinity into inf.
    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _text_is_unicode(cls, value):
        # JSON can spell half of a UTF-16 pair ("\ud800"), which is no character at all: the
        # tokenizer cannot read it and no reply could echo it. Refused here, naming the field.
        for piece in value if isinstance(value, list) else value.keys() if isinstance(value, dict) else [value]:
            if isinstance(piece, str) and not piece.isascii():
                try:
                    piece.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"the text has a lone surrogate (\\u{ord(piece[exc.start]):04x}), "
                                     "which is not a Unicode character") from None
        return value


class ContentPart(_Strict):
    type: str                                 # only "text" is served; others are refused by name
    text: str | None = None


class CalledFunction(_Strict):
    name: str
    arguments: str                            # JSON text, as the server sent it


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")   # see chat_messages()
    role: Literal["system", "developer", "user", "assistant", "tool"]   # developer: OpenAI's newer system
    content: str | list[ContentPart] | None = None   # None only for an assistant's tool calls
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=32)] | None = None   # Chapter 11: an earlier call
    tool_call_id: str | None = None           # a tool message: the call it answers
    # who speaks (OpenAI's, LangChain's HumanMessage(name=)): handed to the chat template as vLLM does;
    # a template with no place for it (SmolLM2's) leaves it out
    name: str | None = Field(None, min_length=1, max_length=64)


class StreamOptions(_Strict):
    include_usage: bool = False


# Fields of OpenAI's API, and of vLLM's extensions to it, that would change the answer but that
# these engines do not implement, each with the values that mean "not used". Sent with another
# value they are a 400 naming the field, not ignored. Fields that change nothing (user, metadata,
# store, ...) are accepted, so that standard clients work.
UNSUPPORTED = {
    "functions": None, "function_call": None,
    "suffix": None, "audio": None, "modalities": None,
    "prediction": None, "web_search_options": None, "reasoning_effort": None, "verbosity": None,
    # vLLM's sampling, output and prompt extensions
    "typical_p": (None, 1, 1.0), "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False), "bad_words": (None, []),
    "allowed_token_ids": None, "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": None,
    "logits_processors": None, "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "chat_template": None, "chat_template_kwargs": None,
}
# Message fields the chat template has no place for.
MESSAGE_UNSUPPORTED = {"function_call": None, "audio": None}


def check_request(req: SamplingFields, model_name: str, adapters: tuple[str, ...] = ()) -> None:
    """Refuse what the request asks for that this server would otherwise ignore, and other models
    (the served one, or one of its LoRA adapters by name, Chapter 17)."""
    refuse_unsupported(req.model_extra or {})
    if isinstance(req, CompletionRequest):
        refuse_unsupported(req.model_extra or {}, NOT_FOR_COMPLETIONS)
    else:   # echo is the legacy completions' (scoring a prompt: kit/scoring_api.py)
        refuse_unsupported(req.model_extra or {}, {"echo": (None, False)})
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.model is not None and req.model != model_name and req.model not in adapters:   # one base model
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.",
                       param="model", code="model_not_found")


def _unused(value, unused) -> bool:
    # type-exact: true == 1 and false == 0 in Python, but best_of=true is not best_of=1
    return any(type(value) is type(u) and value == u for u in (unused if isinstance(unused, tuple) else (unused,)))


def refuse_unsupported(extra: dict, unsupported: dict = UNSUPPORTED, where: str = "") -> None:
    for name, unused in unsupported.items():
        if name in extra and not _unused(extra[name], unused):
            raise APIError(400, f"{where}{name} is not supported by this server", param=where.split("[")[0] or name)


# Chapter 11: structured output (kit/structured_api.py turns these into SamplingParams.structured).
class JSONSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    schema_: dict | None = Field(None, alias="schema")   # SamplingParams bounds its size and depth
    description: str | None = None
    strict: bool | None = None                # strict or not, the reply is held to the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra (its StructuredOutputsParams): exactly one of these."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    parameters: dict | None = None            # a JSON Schema for the arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def field_for(name: str, nullable: bool = False):
    """A pydantic Field with the bounds SamplingParams gives its field `name` (minivllm/contracts.py's
    REQUEST_FIELDS), so the server refuses exactly what the library would. nullable: the default is
    null, which means off, where SamplingParams' default is a number."""
    spec = REQUEST_FIELDS[name]
    bounds = {}
    if spec.low is not None:
        bounds["gt" if spec.low_open else "ge"] = spec.low
    if spec.high is not None:
        bounds["lt" if spec.high_open else "le"] = spec.high
    if spec.max_chars is not None and spec.max_items is None:   # one string; a list's are SamplingParams' to check
        bounds.update(min_length=1, max_length=spec.max_chars)
    return Field(None if nullable else spec.default, description=spec.help, **bounds)


class SamplingFields(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")   # extras checked below

    @field_validator("max_tokens", "max_completion_tokens", mode="before", check_fields=False)
    @classmethod
    def _whole_number(cls, value):
        # JSON has one kind of number: 4.0 is the count 4 to OpenAI's API, so to ours; 4.5 is still refused
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    model: str | None = None                  # omitted, or the served model's id
    max_tokens: int | None = field_for("max_tokens")
    temperature: float = field_for("temperature")   # 0 = greedy (OpenAI's default is 1)
    top_p: float = field_for("top_p")
    top_k: int = field_for("top_k")           # vLLM extension; 0 = off
    seed: int | None = field_for("seed")
    stop: str | list[str] | None = None       # its sizes are SamplingParams' to check
    n: int = field_for("n")                   # answers per prompt (Chapter 16: on the prompt's shared blocks)
    best_of: int | None = field_for("best_of")   # OpenAI's legacy completions (vLLM's chat too): n likeliest
    ignore_eos: bool = False                  # vLLM extension, for benchmarks
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Adjustments to the logits (null means off); SamplingParams checks what JSON cannot.
    presence_penalty: float | None = field_for("presence_penalty", nullable=True)
    frequency_penalty: float | None = field_for("frequency_penalty", nullable=True)
    repetition_penalty: float | None = field_for("repetition_penalty", nullable=True)  # vLLM extension; 1 = off
    logit_bias: dict[str, float] | None = None   # JSON keys are strings: token id -> added to its logit
    response_format: ResponseFormat | None = None  # Chapter 11: JSON, or JSON matching a schema
    guided_json: dict | str | None = None     # vLLM's extensions: the same, and a regex, a list, a grammar
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's field: prefix-cache blocks are shared only among requests with the same salt (Chapter 8)
    cache_salt: str | None = field_for("cache_salt")
    # vLLM's sampling extensions, bounded as SamplingParams bounds them
    min_p: float = field_for("min_p")
    min_tokens: int = field_for("min_tokens")
    stop_token_ids: list[int] | None = None   # its length is SamplingParams' to check
    structured_outputs: StructuredOutputs | None = None   # vLLM's current extra: one of json, regex, ...
    prompt_logprobs: int | None = field_for("prompt_logprobs")   # vLLM's: each prompt token's (kit/scoring_api.py)

    def token_limit(self) -> tuple[int | None, str]:
        """The requested number of new tokens, and the field that asked for it."""
        return self.max_tokens, "max_tokens"


def _at_most(limit: int, what: str):
    """A 'before' validator: a list too long is refused on its length, before its items are read."""
    def check(value):   # (one prompt's token ids are a list of ints: the context window bounds those)
        if isinstance(value, list) and len(value) > limit and not all(type(v) is int for v in value):
            raise ValueError(f"at most {limit} {what} in one request, got {len(value)}")
        return value
    return field_validator("messages" if what == "messages" else "prompt", mode="before")(check)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    _few_messages = _at_most(MAX_MESSAGES, "messages")
    max_completion_tokens: int | None = field_for("max_tokens")   # OpenAI's newer name for max_tokens
    logprobs: bool | None = None              # the chosen tokens' log-probabilities ...
    top_logprobs: int | None = field_for("logprobs")   # ... and this many alternatives each
    tools: Annotated[list[Tool], Field(max_length=32)] | None = None   # functions the reply may call
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def token_limit(self) -> tuple[int | None, str]:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree; send one of them",
                           param="max_completion_tokens")
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingFields):
    # text, token ids, or a list of either: a list of prompts is answered as one batch
    prompt: str | list[str] | list[int] | list[list[int]]
    _few_prompts = _at_most(MAX_PROMPTS, "prompts")
    logprobs: int | None = field_for("logprobs")   # legacy form: the number of alternatives
    # Scoring a prompt (kit/scoring_api.py): 0 new tokens only with echo
    max_tokens: int | None = Field(None, ge=0, description="a cap on new tokens; 0: score the prompt (with echo)")
    echo: bool = False                        # the prompt comes back before the answer, with its logprobs


# Chat-only fields sent to /v1/completions are refused, not ignored (null is "not sent").
NOT_FOR_COMPLETIONS = dict.fromkeys(sorted(ChatRequest.model_fields.keys() - CompletionRequest.model_fields.keys()))
# --8<-- [end:request-models]


ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "GET /v1/models",
          "GET /v1/models/{model}")


# --8<-- [start:errors]
class APIError(Exception):
    """An error the client should see, in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.code = code or str(status)   # a string, as OpenAI's ("model_not_found"); the status where none names it

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def from_engine_error(exc: Exception) -> APIError:
    """The engine refused the request (ValueError: e.g. prompt too long) or broke (anything else)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:   # a task group's one failure
        exc = exc.exceptions[0]
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailable):   # e.g. a tensor-parallel worker died: the process is ending
        return APIError(503, f"the engine is unavailable: {exc}", type_="server_error")
    if isinstance(exc, ValueError):   # the library's messages start with the field they refuse
        field = (str(exc).split(maxsplit=1) or [""])[0]
        known = field in ChatRequest.model_fields or field in CompletionRequest.model_fields
        return APIError(400, str(exc), param=field if known else None)
    log.error("engine failed", exc_info=exc)
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type_="server_error")


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own shape; OpenAI clients expect 400 and {"error": ...}.
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return await api_error(request, APIError(400, f"the body is not valid JSON: {err['ctx']['error']} "
                                                          f"at character {err['loc'][-1]}"))
        if isinstance(err.get("input"), bytes):   # FastAPI reads JSON only when the client says it is JSON
            ctype = request.headers.get("content-type", "")
            return await api_error(request, APIError(415, f"the body must be JSON, sent with 'Content-Type: "
                                                          f"application/json' (this one says {ctype!r})"))
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if loc[:1] == ["prompt"] and err.get("type") in ("value_error", "string_type"):
            loc = loc[:1]   # not "prompt.str: ...": which branch of str | list[str] failed says nothing
        message = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value').removeprefix('Value error, ')}"
        spec = next((s for s in REQUEST_FIELDS.values() if loc in ([s.name], [s.openai])), None)
        if spec is not None and err.get("type") in ("greater_than", "greater_than_equal", "less_than",
                                                     "less_than_equal"):
            message = spec.refusal(err["input"], loc[0])   # the library's words, under the request's name
        return await api_error(request, APIError(400, message, param=loc[0] if loc else None))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405) and exc.detail in ("Not Found", "Method Not Allowed"):   # no such route
            response = await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path} is "
                                       f"not a route of this server; it serves {', '.join(ROUTES)}", code="unknown_route"))
        else:
            response = await api_error(request, APIError(exc.status_code, unreadable(exc) or str(exc.detail)))
        response.headers.update(exc.headers or {})   # a 405's Allow (RFC 9110 requires it), a 401's challenge
        return response

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return await api_error(_, from_engine_error(exc))  # a JSON 500, and the server lives on

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
# --8<-- [end:errors]


def unreadable(exc: StarletteHTTPException) -> str | None:
    """FastAPI says "There was an error parsing the body" for every way json.loads can fail but
    bad syntax; the error it wraps says which."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 text: byte 0x{cause.object[cause.start]:02x} at position {cause.start}"
    if isinstance(cause, RecursionError):   # a backstop: JsonDepth refuses such bodies first
        return "the body's JSON is nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):   # Python's cap on int() of long text
        return f"the body has a number too long to read: {cause}"
    if cause is not None and exc.status_code == 400:
        return f"the body could not be read as JSON: {type(cause).__name__}: {cause}"
    return None


def sampling_params(req: SamplingFields, params_class: type, cache_salt=lambda salt: salt):
    """The request's sampling fields as the engine's SamplingParams (03_contracts, passed in by the server:
    this package imports no chapter script)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    # Plain decimal token ids only: Python's int() would also read " 1", "+1", "1_0" and "١٢",
    # and "1" and "01" would name the same token twice.
    keys = list(req.logit_bias or {})
    if not all(k.isascii() and k.isdigit() and (k == "0" or k[0] != "0") for k in keys):
        raise APIError(400, "logit_bias keys must be token ids written as plain decimal integers",
                       param="logit_bias")
    bias = {int(token): value for token, value in (req.logit_bias or {}).items()}
    adjustments = {k: v for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                   if (v := getattr(req, k)) is not None}   # null: SamplingParams' default, which is off
    try:
        structured, field = structured_api.requested_constraint(req)
    except structured_api.FieldError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
    best_of = req.best_of
    if req.stream and best_of is not None and best_of > 1:   # OpenAI's rule: the best is known only at the end
        raise APIError(400, "best_of cannot be used with stream", param="best_of")
    try:
        params = params_class(n=req.n, best_of=best_of, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                              min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids or (),
                              seed=req.seed, stop=() if req.stop is None else req.stop, ignore_eos=req.ignore_eos,
                              logit_bias=bias, logprobs=logprobs, structured=structured, cache_salt=cache_salt(req.cache_salt),
                              prompt_logprobs=scoring_api.prompt_logprobs(req), **adjustments)
        if params.structured is not None:   # does it parse? asked now, whatever engine serves it
            StructuredOutput().check(params.structured)
        return params
    except ValueError as exc:   # SamplingParams' messages start with the field's name
        if str(exc).startswith("structured"):   # ... which is not the request's: name the one that asked
            raise APIError(400, f"{field}: {str(exc).removeprefix('structured ')}", param=field) from exc
        raise from_engine_error(exc) from exc


# --8<-- [start:logprobs]
def _logprob(value: float) -> float:
    return max(value, -9999.0)   # JSON has no -Infinity; vLLM reports the same floor


def chat_logprobs(tokenizer, entries) -> dict:
    """Chat's shape: each token with its text, bytes, log-probability and alternatives."""
    def one(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tokenizer, entries, offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists, alternatives as {token text: log-probability}."""
    tokens = [tokenizer.decode([e.token_id]) for e in entries]
    starts = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): _logprob(lp) for t, lp in e.top} for e in entries],
            "text_offset": starts}
# --8<-- [end:logprobs]


MAX_BODY_BYTES = 2 << 20   # 2 MiB: far more text than any context window here holds
MAX_JSON_DEPTH = 64        # OpenAI's bodies nest a handful of levels; a schema, a few dozen at most


class JsonDepth:
    """The nesting depth of JSON text read in pieces, outside strings. Python's json module
    recurses once per level, so without a bound the deepest body a server accepts is whatever
    the process's recursion limit happens to be (torch.compile raises it): counted here, a body
    nested deeper than MAX_JSON_DEPTH is refused the same way on every machine."""

    def __init__(self, limit: int = MAX_JSON_DEPTH):
        self.limit, self.depth, self.in_string, self.escaped = limit, 0, False, False

    # Only these bytes can change the depth or the string state: a 2 MiB body of text is scanned
    # by the regex engine, not byte by byte in Python on the event loop.
    STRUCTURE = re.compile(rb'[\[\]{}"\\]')

    def feed(self, chunk: bytes) -> None:
        escaped_at = 0 if self.escaped else -1   # the byte a backslash before it escapes
        self.escaped = False
        for match in self.STRUCTURE.finditer(chunk):
            i = match.start()
            byte = chunk[i]
            if i == escaped_at:
                continue
            if self.in_string:
                if byte == 0x5C:                    # backslash: the next byte, maybe in the next piece
                    escaped_at = i + 1
                    self.escaped = escaped_at == len(chunk)
                elif byte == 0x22:                  # closing quote
                    self.in_string = False
            elif byte == 0x22:
                self.in_string = True
            elif byte in (0x5B, 0x7B):              # [ {
                self.depth += 1
                if self.depth > self.limit:
                    raise StarletteHTTPException(400, f"the body's JSON is nested too deeply "
                                                      f"(more than {self.limit} levels)")
            elif byte in (0x5D, 0x7D):              # ] }
                self.depth -= 1


class BodyLimit:
    """Refuse a request body over max_bytes with a 413, counting as it arrives, before parsing;
    and one that has not arrived whole within timeout_s with a 408 (a Content-Length larger than
    what is sent would otherwise hold the connection, and a worker, for ever)."""

    def __init__(self, app, max_bytes: int, timeout_s: float | None = None):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen, whole = 0, False
        is_json = b"json" in dict(scope.get("headers", ())).get(b"content-type", b"").lower()
        depth = JsonDepth() if is_json else None
        deadline = None if not self.timeout_s else anyio.current_time() + self.timeout_s

        async def counted():
            nonlocal seen, whole
            if whole or deadline is None:   # after the body: a wait for the client to hang up
                return await receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
                seen += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if seen > self.max_bytes:   # a chunked body that never declared its length
                    raise StarletteHTTPException(413, self._message())
                if depth is not None:
                    depth.feed(message.get("body", b""))
                return message
            raise StarletteHTTPException(408, f"the request body did not arrive within {self.timeout_s:g} "
                                              f"seconds ({seen} bytes came)")

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def _refuse(self, scope, receive, send):
        await JSONResponse(APIError(413, self._message()).body(), status_code=413)(scope, receive, send)


def chat_messages(messages: list) -> list[dict]:
    """OpenAI's message forms as the chat template expects them: text parts joined, developer as system."""
    out = []
    for i, m in enumerate(messages):
        refuse_unsupported(m.model_extra or {}, MESSAGE_UNSUPPORTED, where=f"messages[{i}].")
        content = m.content
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages[{i}]: only an assistant message has tool_calls", param="messages")
        if content is None and not m.tool_calls:
            raise APIError(400, f"messages[{i}].content is required", param="messages")
        if content is None:
            content = ""
        elif not isinstance(content, str):
            refused = [p.type for p in content if p.type != "text" or p.text is None]
            if refused:
                raise APIError(400, f"messages[{i}].content: only text parts are supported, got {refused[0]!r}",
                               param="messages")
            content = "".join(p.text for p in content)
        # An earlier tool call goes back into the conversation as the text the model wrote for it.
        content += "".join(structured_api.call_text(c.function.name, c.function.arguments) for c in m.tool_calls or ())
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content,
                    **({"name": m.name} if m.name is not None else {})})
    return out


VLLM_SAMPLING = ("min_p", "min_tokens", "stop_token_ids")


def check_engine_sampling(params, honours_vllm_sampling: bool) -> None:
    """vLLM's sampling fields, refused for an engine that would ignore them (EngineCapabilities)."""
    asked = [name for name in VLLM_SAMPLING if getattr(params, name)]
    if asked and not honours_vllm_sampling:
        raise APIError(400, f"{asked[0]} is not supported by this engine (the assembled engine, "
                            f"minivllm:LLM, has it)", param=asked[0])


def check_engine_answers(params, parallel_sampling: bool) -> None:
    """n and best_of above 1, refused for an engine that gives one answer per prompt (Chapter 16)."""
    if params.num_sequences > 1 and not parallel_sampling:
        raise APIError(400, f"n = {params.num_sequences} answers per prompt is not supported by this engine "
                            f"(the assembled engine, minivllm:LLM, has it)",
                       param="best_of" if params.best_of and params.best_of > params.n else "n")


def chat_ids(tokenizer, messages: list[dict], render=None) -> list[int]:
    """The conversation's ids, each message's text read as text (minivllm/text.py); a template
    that rewrites message text is a 400 that says where to send the prompt instead."""
    try:
        return text.chat_ids(tokenizer, messages, render or text.render_chat)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def sse(obj: dict | str) -> str:
    """One Server-Sent Event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def usage(results) -> dict:
    prompt = sum(r.metrics.input_tokens for r in results)
    completion = sum(r.metrics.output_tokens for r in results)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = [r.metrics.cached_tokens for r in results if r.metrics.cached_tokens is not None]
    if cached:   # OpenAI's field; only engines with a prefix cache (Chapter 8) measure it
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    drafted = sum(r.metrics.draft_tokens or 0 for r in results)
    if drafted:   # speculative decoding (Chapter 10), in OpenAI's words for guessed tokens
        accepted = sum(r.metrics.accepted_tokens or 0 for r in results)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def chat_choice(index: int, answer, tokenizer, tools: bool) -> dict:
    """One answer (a CompletionOutput) as a chat choice. tools: a call in it becomes `tool_calls`."""
    message, finish = {"role": "assistant", "content": answer.text}, answer.finish_reason
    call = structured_api.parse_tool_call(answer.text) if tools else None
    if call:
        message, finish = {"role": "assistant", "content": call[0], "tool_calls": [call[1]]}, "tool_calls"
    elif tools:   # a call cut short by max_tokens or a stop string: its finish_reason says why
        kept = structured_api.without_unfinished_call(answer.text, cut_short=finish == "length")
        message["content"] = kept.strip() or None
    return {"index": index, "message": message,
            "logprobs": None if answer.logprobs is None else chat_logprobs(tokenizer, answer.logprobs),
            "finish_reason": finish}


def chat_completion(rid: str, created: int, model_name: str, result, tokenizer, tools: bool = False) -> dict:
    """A chat answer, a choice per answer the request asked for (n); `metrics` (the engine's own
    measurements) is an extension of OpenAI's shape. tools: the request offered functions."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model_name,
        "choices": [chat_choice(i, answer, tokenizer, tools) for i, answer in enumerate(result.outputs)],
        "usage": usage([result]),
        "metrics": result.metrics.as_dict(),
    }


def text_completion(rid: str, created: int, model_name: str, results: list, tokenizer, single: bool,
                    req: CompletionRequest | None = None, prompts: list | None = None) -> dict:
    """A completions answer: n choices per prompt, prompt by prompt (OpenAI's order); `metrics` is one
    dict for a single prompt, else a list. req and prompts: a request that scores its prompts (echo,
    prompt_logprobs, max_tokens 0: kit/scoring_api.py)."""
    metrics = [r.metrics.as_dict() for r in results]
    answers = [(a, r, p) for r, p in zip(results, prompts or [None] * len(results)) for a in r.outputs]
    choices = [{"index": i, "text": a.text,
                "logprobs": None if a.logprobs is None else completion_logprobs(tokenizer, a.logprobs),
                "finish_reason": a.finish_reason} for i, (a, _, _) in enumerate(answers)]
    counted = usage(results)
    if req is not None and (req.echo or req.prompt_logprobs is not None or req.max_tokens == 0):
        choices = [scoring_api.echoed(c, r, p, tokenizer, req.max_tokens == 0, req.echo, req.prompt_logprobs is not None,
                                      _logprob) for c, (_, r, p) in zip(choices, answers)]
        if req.max_tokens == 0:   # the token that ran the prefill is not an answer
            counted.update(completion_tokens=0, total_tokens=counted["prompt_tokens"])
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model_name,
        "choices": choices, "usage": counted, "metrics": metrics[0] if single else metrics,
    }


def chunk_maker(kind: str, rid: str, created: int, chat: bool, tokenizer, model_name: str,
                index: int = 0) -> Callable[..., dict]:
    """One streamed answer's chunks (the request's answer `index`, Chapter 16). It remembers what it
    sent, so that each log-probability goes out once."""
    sent = {"entries": 0, "chars": 0}   # log-probabilities and text already streamed

    def chunk(delta, finish_reason=None, result=None) -> dict:
        text = delta.get("content", "") if chat else delta
        # A piece carries its tokens' log-probabilities; the final chunk brings any left
        # over (a token without text, such as EOS, or an engine whose pieces carry none).
        entries = list(getattr(text, "logprobs", ()))
        if result is not None and result.logprobs:
            entries += result.logprobs[sent["entries"] + len(entries):]
        logprobs = None
        if entries:
            logprobs = chat_logprobs(tokenizer, entries) if chat else \
                completion_logprobs(tokenizer, entries, sent["chars"])
        sent["entries"] += len(entries)
        sent["chars"] += len(text)
        choice = {"index": index, "delta": delta} if chat else {"index": index, "text": delta}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]}
    return chunk
