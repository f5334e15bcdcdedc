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
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from kit import cli
from kit import openai_api as api   # the wire format: request bodies, errors, answer shapes
from kit import server_ops          # keys, metrics, overload, shutdown, the page
from kit.bridge import all_or_nothing, run_ahead, until_disconnected   # blocking engine, asyncio server
from kit.openai_api import APIError, ChatRequest, CompletionRequest, SamplingFields, from_engine_error, sse

engine_lib = importlib.import_module("04_engine")
SamplingParams = engine_lib.SamplingParams

DEFAULT_ENGINE = "04_engine:BaselineEngine"
DEFAULT_MAX_TOKENS = 128


# --8<-- [start:make-app]
def make_app(engine, model_name: str | None = None, ops=None, max_body_bytes: int = api.MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible FastAPI app around any BaseOfflineEngine."""
    model_name = model_name or getattr(engine, "model_name", None) or type(engine).__name__
    context_length = getattr(engine, "context_length", None)
    app = FastAPI(title="llm-engine-companion", version="0.1.0")
    api.install_error_handlers(app)
    app.add_middleware(api.BodyLimit, max_bytes=max_body_bytes)
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
            call = asyncio.ensure_future(run_in_threadpool(fn, *args))
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:   # a hang-up or a timeout: the thread cannot be stopped,
                with anyio.CancelScope(shield=True):   # so the lock stays held until the engine is free
                    await asyncio.wait({call})
                raise
            except Exception as exc:
                raise from_engine_error(exc) from exc
    # --8<-- [end:queue-lock]

    def token_budget(prompt: str, requested: int | None, field: str = "max_tokens") -> int:
        if requested is not None:
            if context_length and requested > context_length:
                raise APIError(400, f"{field} is {requested}, but this model's maximum context "
                                    f"length is {context_length} tokens.", param=field)
            return requested
        if not context_length:
            return DEFAULT_MAX_TOKENS
        n_prompt = len(engine.tokenizer(prompt).input_ids)  # default: what is left, at most 128
        return max(1, min(DEFAULT_MAX_TOKENS, context_length - n_prompt))

    def check_model(req: SamplingFields) -> None:
        api.check_fields(req)
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
        handed.add_done_callback(lambda _: lock.handed_over())   # now counted in the engine's queue
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
                yield sse({**chunk({}), "choices": [], "usage": api.usage([item])})
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

    # --8<-- [start:chat-endpoint]
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        messages = api.chat_messages(req.messages)
        params = api.sampling_params(req, SamplingParams)

        def prepare() -> tuple[str, int]:   # template and tokenizer: in a thread, not on the event loop
            prompt = engine_lib.render_chat(engine.tokenizer, messages)
            return prompt, token_budget(prompt, *req.token_limit())

        prompt, max_tokens = await run_in_threadpool(prepare)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunk = api.chunk_maker("chat.completion.chunk", rid, created, True, engine.tokenizer, model_name)
            return await streaming_response(prompt, max_tokens, params, chunk, True, req, request)
        result = await until_disconnected(request, generate_one(prompt, max_tokens, params))
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None if result.logprobs is None else
                         api.chat_logprobs(engine.tokenizer, result.logprobs),
                         "finish_reason": result.finish_reason}],
            "usage": api.usage([result]),
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
        params = api.sampling_params(req, SamplingParams)
        budgets = await run_in_threadpool(lambda: [token_budget(p, req.max_tokens) for p in prompts])
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            if len(prompts) > 1:
                raise APIError(400, "streaming takes a single prompt", param="prompt")
            chunk = api.chunk_maker("text_completion", rid, created, False, engine.tokenizer, model_name)
            return await streaming_response(prompts[0], budgets[0], params, chunk, False, req, request)
        if len(prompts) > 1:    # all or none: one bad prompt refuses the list before any work
            try:
                await run_in_threadpool(check_all, prompts, budgets, params)
            except Exception as exc:
                raise from_engine_error(exc) from exc
        if len(prompts) == 1 or batching:   # a batching engine runs them together
            work = all_or_nothing(generate_one(p, b, params) for p, b in zip(prompts, budgets))
        else:
            work = generate_list(prompts, budgets, params)
        results = await until_disconnected(request, work)   # a hang-up stops the work
        metrics = [r.metrics.as_dict() for r in results]
        return {
            "id": rid, "object": "text_completion", "created": created, "model": model_name,
            "choices": [{"index": i, "text": r.text,
                         "logprobs": None if r.logprobs is None else api.completion_logprobs(engine.tokenizer, r.logprobs),
                         "finish_reason": r.finish_reason} for i, r in enumerate(results)],
            "usage": api.usage(results),
            "metrics": metrics[0] if isinstance(req.prompt, str) else metrics,
        }

    def check_all(prompts: list[str], budgets: list[int], params: SamplingParams) -> None:
        """What the engine would refuse, for every prompt of a list, before any of them runs."""
        if batching and hasattr(engine, "new_request"):
            for prompt, budget in zip(prompts, budgets):
                engine.new_request(prompt, budget, params)
        elif hasattr(engine, "encode"):   # Chapter 1's checks: text, length, context window
            for prompt, budget in zip(prompts, budgets):
                engine.encode(prompt, params.token_budget(budget))

    async def generate_list(prompts: list[str], budgets: list[int], params: SamplingParams) -> list:
        """A list for a lock-holding engine. One with batches of its own (Chapter 5's max_batch_size)
        runs generate_batch a batch at a time, each of prompts with the same budget: a hang-up or a
        timeout stops the list at the end of the running batch. One without streams each prompt in
        turn, and stops at the next token."""
        size = getattr(engine, "max_batch_size", None)
        if not size:
            return [await generate_one(p, b, params) for p, b in zip(prompts, budgets)]
        results = [None] * len(prompts)
        for budget in sorted(set(budgets)):
            rows = [i for i, b in enumerate(budgets) if b == budget]
            for start in range(0, len(rows), size):
                chunk = rows[start: start + size]
                batch = await call_engine(engine.generate_batch, [prompts[i] for i in chunk], budget, params)
                for i, result in zip(chunk, batch):
                    results[i] = result
        return results

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
    parser.add_argument("--port", type=cli.integer(1, 65535), default=8001)
    parser.add_argument("--model", default=os.environ.get("ENGINE_MODEL"),
                        help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", default=os.environ.get("ENGINE_CLASS", DEFAULT_ENGINE),
                        help="the engine class as module:Class")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    batching = parser.add_argument_group("continuous batching (engines of Chapter 7 on; omitted: their defaults)")
    batching.add_argument("--kv-memory", default=None, help="KV pool size, e.g. 512MB")
    batching.add_argument("--max-num-seqs", type=cli.integer(1), default=None, help="sequences in one step, at most")
    batching.add_argument("--max-num-batched-tokens", type=cli.integer(1), default=None,
                          help="tokens in one step, at most")
    batching.add_argument("--prefix-caching", action="store_true", default=None,
                          help="reuse the KV blocks of prompt prefixes seen before (Chapter 8)")
    server_ops.add_arguments(parser)
    args = parser.parse_args()
    if not args.host.strip():   # '' would listen on every interface, not on none
        parser.error("--host must name an address: 127.0.0.1 (this machine only) or 0.0.0.0 (the network)")

    try:
        ops = server_ops.ServerOps.from_args(args)   # bad values fail before the model loads
        engine = engine_lib.load_engine(args.engine, args.model, device=args.device, **engine_options(args))
    except ValueError as exc:
        parser.error(str(exc))
    print(f"[server] {args.engine} on http://{args.host}:{args.port}/v1", flush=True)
    server_ops.serve(make_app(engine, ops=ops), ops, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
