"""05_server.py - any engine behind an OpenAI-compatible HTTP API.

The engines speak Python; the ecosystem speaks OpenAI's HTTP API (curl, the `openai`
package, benchmark tools). `make_app(engine)` bridges the two for every chapter's
engine, because it only uses what all of them share: `generate`, `generate_batch`,
the tokenizer (for the chat template) and, where an engine has it, `generate_stream`.

    python 05_server.py --port 8001                    # Chapter 1's BaselineEngine
    python 05_server.py --port 8001 --engine 04_engine:BaselineEngine --model SmolLM2-135M-Instruct
    ENGINE_CLASS=04_engine:BaselineEngine uvicorn 05_server:app --port 8001
    python 05_server.py --engine 13_continuous_batching:ContinuousBatchingEngine --kv-memory 512MB --max-num-seqs 32
    curl -s http://127.0.0.1:8001/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32}'

Chapter 1's engines answer one request at a time, so the server queues requests behind a
lock. An engine that offers `submit` (Chapter 9) batches live requests itself: the server
hands each request straight to its scheduler, and concurrent users share every step.

Defaults differ from OpenAI's on purpose: `temperature` defaults to 0 (greedy, so the
same request gives the same answer; OpenAI's default is 1) and `max_tokens` to 128,
capped by what is left of the context window. Like vLLM we also accept `top_k`,
`repetition_penalty` and `ignore_eos`. Logit bias, presence/frequency penalties and
logprobs are honoured; tools, response_format, n > 1 and the like are a 400, never ignored.
One server, one model: `model` may be omitted or name it; any other is a 404.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

engine_lib = importlib.import_module("04_engine")
cpu_threads = importlib.import_module("cpu_threads")
server_ops = importlib.import_module("server_ops")  # keys, metrics, overload, shutdown, the page
SamplingParams = importlib.import_module("03_contracts").SamplingParams

DEFAULT_ENGINE = "04_engine:BaselineEngine"
DEFAULT_MAX_TOKENS = 128
log = logging.getLogger("05_server")


# --8<-- [start:request-models]
class _Strict(BaseModel):
    # strict: "0.7" is not a temperature and true is not a token count; unknown fields are ignored.
    # allow_inf_nan=False: Python's JSON reader turns 1e999 and Infinity into inf.
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class ContentPart(_Strict):
    type: str                                 # only "text" is served; others are refused by name
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]   # developer: OpenAI's newer system
    content: str | list[ContentPart]


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI fields that would change the answer but that these engines do not implement, each
# with the value that means "not used". Sent with another value they are a 400, not ignored.
UNSUPPORTED = {"tools": None, "tool_choice": None, "functions": None, "function_call": None,
               "response_format": None, "best_of": (None, 1), "echo": (None, False),
               "suffix": None, "min_p": (None, 0, 0.0), "audio": None, "modalities": None, "prediction": None}


def refuse_unsupported(extra: dict) -> None:
    for name, unused in UNSUPPORTED.items():
        if name in extra and extra[name] not in (unused if isinstance(unused, tuple) else (unused,)):
            raise APIError(400, f"{name} is not supported by this server", param=name)


class SamplingFields(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")   # extras checked below
    model: str | None = None                  # omitted, or the served model's id
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)   # 0 = greedy (OpenAI: 0 to 2, default 1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)               # vLLM extension; 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)             # one choice per prompt: no parallel sampling here
    ignore_eos: bool = False                  # vLLM extension, for benchmarks
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Adjustments to the logits (null means off); SamplingParams checks what JSON cannot.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)   # vLLM extension; 1 = off
    logit_bias: dict[str, float] | None = None   # JSON keys are strings: token id -> -100..100


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None              # the chosen tokens' log-probabilities ...
    top_logprobs: int | None = Field(None, ge=0, le=20)   # ... and this many alternatives each


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)   # legacy form: the number of alternatives
# --8<-- [end:request-models]


# --8<-- [start:errors]
class APIError(Exception):
    """An error the client should see, in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.code = code or status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def from_engine_error(exc: Exception) -> APIError:
    """The engine refused the request (ValueError: e.g. prompt too long) or broke (anything else)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    log.error("engine failed", exc_info=exc)
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type_="server_error")


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own shape; OpenAI clients expect 400 and {"error": ...}.
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return await api_error(_, APIError(400, f"the body is not valid JSON: {err['ctx']['error']} "
                                                    f"at character {err['loc'][-1]}"))
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"
        return await api_error(_, APIError(400, message, param=loc[0] if loc else None))

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return await api_error(_, APIError(exc.status_code, str(exc.detail)))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return await api_error(_, from_engine_error(exc))  # a JSON 500, and the server lives on

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
# --8<-- [end:errors]


def sampling_params(req: SamplingFields) -> SamplingParams:
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    try:
        bias = {int(token): value for token, value in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers)", param="logit_bias") from None
    off = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, stop=() if req.stop is None else req.stop, ignore_eos=req.ignore_eos,
                              logit_bias=bias, logprobs=logprobs,
                              **{k: v if (v := getattr(req, k)) is not None else default for k, default in off.items()})
    except ValueError as exc:   # SamplingParams' messages start with the field's name
        name = str(exc).split()[0]
        raise APIError(400, str(exc), param=name if name in type(req).model_fields else None) from exc


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


class BodyLimit:
    """Refuse a request body over max_bytes with a 413, counting as it arrives, before parsing."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:   # a chunked body that never declared its length
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def _refuse(self, scope, receive, send):
        await JSONResponse(APIError(413, self._message()).body(), status_code=413)(scope, receive, send)


def chat_messages(messages: list) -> list[dict]:
    """OpenAI's message forms as the chat template expects them: text parts joined, developer as system."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if not isinstance(content, str):
            refused = [p.type for p in content if p.type != "text" or p.text is None]
            if refused:
                raise APIError(400, f"messages[{i}].content: only text parts are supported, got {refused[0]!r}",
                               param="messages")
            content = "".join(p.text for p in content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def all_or_nothing(awaitables) -> list:
    """asyncio.gather, except that the first failure cancels the others: their answer is not sent."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def until_disconnected(request: Request, awaitable):
    """Await the work, but cancel it (its clean-up frees the engine) if the client hangs up first."""
    work = asyncio.ensure_future(awaitable)

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise APIError(499, "the client closed the request")   # nobody reads it; logs see why
    return work.result()


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
    return out


# --8<-- [start:make-app]
def make_app(engine, model_name: str | None = None, ops=None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible FastAPI app around any BaseOfflineEngine."""
    model_name = model_name or getattr(engine, "model_name", None) or type(engine).__name__
    context_length = getattr(engine, "context_length", None)
    app = FastAPI(title="llm-engine-companion", version="0.1.0")
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # --8<-- [end:make-app]

    # --8<-- [start:queue-lock]
    # The engines of the early chapters serve one request at a time, so requests queue
    # here: asyncio.Lock wakes its waiters in arrival order (FIFO), and each one holds it
    # for its whole generation, streams included. The blocking engine call runs in a
    # worker thread, so the event loop keeps accepting connections while it waits.
    # An engine with `submit` (Chapter 9's continuous batching) needs no lock: its own
    # scheduler queues requests and runs them together, step by step.
    # server_ops wraps it to count waiters for /metrics and the page, and to refuse past --max-waiting.
    lock = (ops or server_ops.ServerOps()).install(app, engine, APIError)
    batching = callable(getattr(engine, "submit", None))

    async def call_engine(fn: Callable, *args):
        async with lock:
            try:
                return await run_in_threadpool(fn, *args)
            except Exception as exc:
                raise from_engine_error(exc) from exc
    # --8<-- [end:queue-lock]

    def token_budget(prompt: str, requested: int | None) -> int:
        if requested is not None:
            if context_length and requested > context_length:
                raise APIError(400, f"max_tokens is {requested}, but this model's maximum context "
                                    f"length is {context_length} tokens.", param="max_tokens")
            return requested
        if not context_length:
            return DEFAULT_MAX_TOKENS
        n_prompt = len(engine.tokenizer(prompt).input_ids)  # default: what is left, at most 128
        return max(1, min(DEFAULT_MAX_TOKENS, context_length - n_prompt))

    def check_model(req: SamplingFields) -> None:
        refuse_unsupported(req.model_extra or {})
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    # --8<-- [start:answer]
    @contextlib.asynccontextmanager
    async def answer(prompt: str, max_tokens: int, params: SamplingParams) -> AsyncIterator[AsyncIterator]:
        """The engine's answer, read as it is produced: text pieces, then the GenerateResult.

        While the block is open the request holds its place (the lock, or a seat in the
        batching engine's scheduler); leaving it early, a hang-up included, frees the work.
        """
        async with lock:
            items = await submit(prompt, max_tokens, params) if batching else pieces(prompt, max_tokens, params)
            produced = run_ahead(items)
            try:
                yield produced
            finally:
                with anyio.CancelScope(shield=True):   # a cancellation must not skip the clean-up
                    await produced.aclose()
                getattr(items, "cancel", lambda: None)()   # also when nobody started reading it

    async def submit(prompt: str, max_tokens: int, params: SamplingParams) -> Iterator:
        """Hand the request to the batching engine (tokenising in a thread). Refused input is a 4xx
        here, before any work; a caller cancelled meanwhile cancels the request as soon as it exists."""
        handed = asyncio.ensure_future(run_in_threadpool(engine.submit, prompt, max_tokens, params))
        try:
            return await asyncio.shield(handed)
        except asyncio.CancelledError:
            handed.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().cancel())
            raise
        except Exception as exc:
            raise from_engine_error(exc) from exc

    async def generate_one(prompt: str, max_tokens: int, params: SamplingParams):
        """One GenerateResult, taken from the stream so that a hang-up stops it at the next token."""
        async with answer(prompt, max_tokens, params) as produced:
            try:
                async for item in produced:
                    if not isinstance(item, str):
                        return item
                raise RuntimeError("the engine's stream ended without a GenerateResult")
            except Exception as exc:
                raise from_engine_error(exc) from exc
    # --8<-- [end:answer]

    def pieces(prompt: str, max_tokens: int, params: SamplingParams) -> Iterator:
        """Text pieces then the GenerateResult, from generate_stream or, lacking it, generate."""
        if hasattr(engine, "generate_stream"):
            yield from engine.generate_stream(prompt, max_tokens, params)
            return
        result = engine.generate(prompt, max_tokens, params)
        if result.text:
            yield result.text
        yield result

    # --8<-- [start:stream]
    async def run_ahead(items: Iterator) -> AsyncIterator:
        """Drive a blocking iterator from its own thread, so that the engine computes the
        next token while the event loop is still sending the previous one."""
        loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

        def produce() -> None:
            try:
                for item in items:
                    loop.call_soon_threadsafe(queue.put_nowait, ("item", item))
                    if stop.is_set():      # the client is gone: stop at the next token
                        break
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            finally:
                items.close()              # closed by the thread that runs it: stops the engine's work

        producer = threading.Thread(target=produce, daemon=True)
        cpu_threads.release_idle_workers()   # the producer (or the engine's loop) computes, not this thread
        producer.start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            stop.set()
            cancel = getattr(items, "cancel", None)
            if cancel is not None:   # a stream that can be stopped from here: do not wait for its next token
                cancel()
            with anyio.CancelScope(shield=True):   # a cancellation must not skip the clean-up
                await run_in_threadpool(producer.join)

    async def event_stream(prompt: str, max_tokens: int, params: SamplingParams, chunk: Callable[..., dict],
                           chat: bool, include_usage: bool) -> AsyncIterator[str]:
        """SSE events: text as the engine produces it, holding the request's place for the whole stream."""
        async with answer(prompt, max_tokens, params) as produced:
            try:  # before the first event an error can still be a proper 4xx response
                item = await anext(produced, None)
            except Exception as exc:
                raise from_engine_error(exc) from exc
            if chat:
                yield sse(chunk({"role": "assistant", "content": ""}))
            try:
                while isinstance(item, str):
                    yield sse(chunk({"content": item} if chat else item))
                    item = await anext(produced, None)
                if item is None:
                    raise RuntimeError("the engine's stream ended without a GenerateResult")
            except Exception as exc:  # too late for a status code: report it in the stream
                yield sse(from_engine_error(exc).body())
                yield sse("[DONE]")
                return
            final = chunk({} if chat else "", item.finish_reason, result=item)
            final["metrics"] = item.metrics.as_dict()   # non-standard, like the non-streamed reply
            yield sse(final)
            if include_usage:
                yield sse({**chunk({}), "choices": [], "usage": usage([item])})
            yield sse("[DONE]")

    async def streaming_response(prompt: str, max_tokens: int, params: SamplingParams, chunk: Callable,
                                 chat: bool, req: SamplingFields, request: Request) -> StreamingResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = event_stream(prompt, max_tokens, params, chunk, chat, include_usage)
        # Waits for the lock and the first token (4xx if refused); a hang-up meanwhile cancels it.
        first = await until_disconnected(request, events.__anext__())

        async def body() -> AsyncIterator[str]:
            yield first
            async for event in events:
                yield event

        # aclose() runs the cleanup above even if the client left before the body was read.
        return StreamingResponse(body(), media_type="text/event-stream",
                                 background=BackgroundTask(events.aclose))
    # --8<-- [end:stream]

    def chunk_maker(kind: str, rid: str, created: int, chat: bool) -> Callable[..., dict]:
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
                logprobs = chat_logprobs(engine.tokenizer, entries) if chat else \
                    completion_logprobs(engine.tokenizer, entries, sent["chars"])
            sent["entries"] += len(entries)
            sent["chars"] += len(text)
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta}
            choice.update(logprobs=logprobs, finish_reason=finish_reason)
            return {"id": rid, "object": kind, "created": created, "model": model_name,
                    "choices": [choice]}
        return chunk

    # --8<-- [start:chat-endpoint]
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        messages = chat_messages(req.messages)
        params = sampling_params(req)

        def prepare() -> tuple[str, int]:   # template and tokenizer: in a thread, not on the event loop
            prompt = engine_lib.render_chat(engine.tokenizer, messages)
            return prompt, token_budget(prompt, req.max_tokens or req.max_completion_tokens)

        prompt, max_tokens = await run_in_threadpool(prepare)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunk = chunk_maker("chat.completion.chunk", rid, created, chat=True)
            return await streaming_response(prompt, max_tokens, params, chunk, True, req, request)
        result = await until_disconnected(request, generate_one(prompt, max_tokens, params))
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None if result.logprobs is None else
                         chat_logprobs(engine.tokenizer, result.logprobs),
                         "finish_reason": result.finish_reason}],
            "usage": usage([result]),
            "metrics": result.metrics.as_dict(),
        }
    # --8<-- [end:chat-endpoint]

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        """A raw prompt, no chat template. A list of prompts goes to generate_batch."""
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not prompts or not all(prompts):
            raise APIError(400, "prompt must be a non-empty string or a list of them", param="prompt")
        check_model(req)
        params = sampling_params(req)
        max_tokens = await run_in_threadpool(lambda: min(token_budget(p, req.max_tokens) for p in prompts))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            if len(prompts) > 1:
                raise APIError(400, "streaming takes a single prompt", param="prompt")
            chunk = chunk_maker("text_completion", rid, created, chat=False)
            return await streaming_response(prompts[0], max_tokens, params, chunk, False, req, request)
        if batching and len(prompts) > 1 and hasattr(engine, "new_request"):   # all or none: one bad
            try:                                                               # prompt refuses the list
                await run_in_threadpool(lambda: [engine.new_request(p, max_tokens, params) for p in prompts])
            except Exception as exc:
                raise from_engine_error(exc) from exc
        if len(prompts) == 1 or batching:   # cancellable on a hang-up; a batching engine runs them together
            results = await until_disconnected(
                request, all_or_nothing(generate_one(p, max_tokens, params) for p in prompts))
        else:                   # a lock-holding engine's own generate_batch, run to its end
            results = await call_engine(engine.generate_batch, prompts, max_tokens, params)
        metrics = [r.metrics.as_dict() for r in results]
        return {
            "id": rid, "object": "text_completion", "created": created, "model": model_name,
            "choices": [{"index": i, "text": r.text,
                         "logprobs": None if r.logprobs is None else completion_logprobs(engine.tokenizer, r.logprobs),
                         "finish_reason": r.finish_reason} for i, r in enumerate(results)],
            "usage": usage(results),
            "metrics": metrics[0] if isinstance(req.prompt, str) else metrics,
        }

    # --8<-- [start:small-endpoints]
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "llm-engine-companion"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app
    # --8<-- [end:small-endpoints]


def __getattr__(name: str):
    """`uvicorn 05_server:app` builds the default engine on first use, not at import (PEP 562)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    engine = engine_lib.load_engine(os.environ.get("ENGINE_CLASS", DEFAULT_ENGINE),
                                    os.environ.get("ENGINE_MODEL"))
    globals()["app"] = app = make_app(engine)
    return app


def free_port() -> int:
    """A loopback port nobody is listening on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --8<-- [start:subprocess]
@contextlib.contextmanager
def serve_in_subprocess(model: str | None = None, engine: str = DEFAULT_ENGINE, device: str | None = None,
                        startup_timeout_s: float = 180.0, env: dict | None = None,
                        args: tuple[str, ...] = ()) -> Iterator[str]:
    """Run this server as its own process on a free loopback port; yield its base URL.

    Waits until /health answers, and stops the server when the block ends, however it
    ends (an exception, Ctrl-C). Benchmarks, end-to-end tests and the book all use it.
    """
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--host", "127.0.0.1", "--port", str(port),
           "--engine", engine] + (["--model", model] if model else []) + (["--device", device] if device else []) + list(args)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent,
                                env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + startup_timeout_s
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = "".join(log.readlines()[-15:])
                    raise RuntimeError(f"the server ({engine}) did not come up, exit code {proc.returncode}:\n{tail}")
                time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
# --8<-- [end:subprocess]


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keywords given on the command line; an engine that does not take one refuses it."""
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "prefix_caching": args.prefix_caching}
    if args.kv_memory is not None:   # '512MB' style sizes are Chapter 7's; only parsed when asked for
        options["kv_memory"] = importlib.import_module("11_paged_kv_demo").parse_bytes(args.kv_memory)
    return {k: v for k, v in options.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve an engine over OpenAI's HTTP API.")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 exposes it to the network")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default=os.environ.get("ENGINE_MODEL"),
                        help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", default=os.environ.get("ENGINE_CLASS", DEFAULT_ENGINE),
                        help="the engine class as module:Class")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    batching = parser.add_argument_group("continuous batching (engines of Chapter 7 on; omitted: their defaults)")
    batching.add_argument("--kv-memory", default=None, help="KV pool size, e.g. 512MB")
    batching.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one step, at most")
    batching.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens in one step, at most")
    batching.add_argument("--prefix-caching", action="store_true", default=None,
                          help="reuse the KV blocks of prompt prefixes seen before (Chapter 8)")
    server_ops.add_arguments(parser)
    args = parser.parse_args()

    try:
        ops = server_ops.ServerOps.from_args(args)   # bad values fail before the model loads
        engine = engine_lib.load_engine(args.engine, args.model, device=args.device, **engine_options(args))
    except ValueError as exc:
        parser.error(str(exc))
    print(f"[server] {args.engine} on http://{args.host}:{args.port}/v1", flush=True)
    server_ops.serve(make_app(engine, ops=ops), ops, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
