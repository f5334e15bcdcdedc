"""05_server.py - any engine behind an OpenAI-compatible HTTP API.

The engines speak Python; the ecosystem speaks OpenAI's HTTP API (curl, the `openai`
package, benchmark tools). `make_app(engine)` bridges the two for every chapter's
engine, because it only uses what all of them share: `generate`, `generate_batch`,
the tokenizer (for the chat template), and the record `capabilities()` in which each engine
states what else it can do (stream, take token ids, schedule requests itself, ...).

    python 05_server.py --port 8001                    # Chapter 1's BaselineEngine
    python 05_server.py --port 8001 --engine 04_engine:BaselineEngine --model SmolLM2-135M-Instruct
    ENGINE_CLASS=04_engine:BaselineEngine uvicorn --factory 05_server:create_app --port 8001
    python 05_server.py --engine minivllm:LLM --kv-memory 512MB --quant int8
    ENGINE_CLASS="16_quantization_engine:QuantizedEngine --quant int4" uvicorn --factory 05_server:create_app
    curl -s http://127.0.0.1:8001/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32}'

A request's path is the order of `OpenAIServer`'s methods: an endpoint checks the request,
`prepare` sets its token budget, `answers` waits for the engine's turn and runs it, and the
endpoint shapes the GenerateResult into OpenAI's JSON or a stream of events. Chapter 1's
engines answer one request at a time, so requests queue for their turn; an engine whose record
says it schedules itself (Chapter 9) gets each request at once, tokenised, and concurrent users
share its steps.

Defaults differ from OpenAI's on purpose: `temperature` defaults to 0 (greedy, so the
same request gives the same answer; OpenAI's default is 1) and `max_tokens` to 128,
capped by what is left of the context window. Like vLLM we also accept `top_k`,
`repetition_penalty` and `ignore_eos`. Logit bias, presence/frequency penalties and
logprobs are honoured, and so are response_format, tools and vLLM's guided_* fields (Chapter 11:
the reply is constrained to the format). n > 1 and the like are a 400, never ignored.
One server, one model: `model` may be omitted or name it, or name one of the LoRA adapters the
engine serves (Chapter 17, `--enable-lora --lora-modules name=path`, and with `--lora-dir`
loaded while serving); any other is a 404.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from kit import adapter_routes      # Chapter 17: adapters by name, loaded while serving
from kit import cli
from kit import openai_api as api   # the wire format: request bodies, errors, answer shapes
from kit import openapi_doc         # the OpenAPI document: every status a route answers
from kit import scoring_api         # echo, prompt_logprobs, max_tokens 0: scoring a prompt
from kit import responses_api       # /v1/responses: text in and out, over the chat route
from kit import replica_server      # Chapter 18: --replicas N on Ray Serve (Ray is imported only then)
from kit import server_ops          # admission, keys, metrics, timeouts, shutdown, the page
from kit import structured_api      # Chapter 11: response_format, guided_*, tools
from kit.bridge import all_or_nothing, in_thread, run_ahead, until_disconnected   # blocking engine, asyncio server
from kit.engines import DEFAULT_ENGINE, load_engine
from kit.openai_api import APIError, ChatRequest, CompletionRequest, from_engine_error, sse
from minivllm.contracts import BaseOfflineEngine, SamplingParams, piece_index
from minivllm.text import render_chat

DEFAULT_MAX_TOKENS = 128


# --8<-- [start:make-app]
def make_app(engine: BaseOfflineEngine, model_name: str | None = None, ops: server_ops.ServerOps | None = None,
             max_body_bytes: int = api.MAX_BODY_BYTES, lora_dir: str | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app around any engine: each route is a method of OpenAIServer.
    lora_dir (Chapter 17): adapters the admin key may load and unload while serving."""
    ops = ops or server_ops.ServerOps()
    app = FastAPI(title="llm-engine-companion", version="0.1.0")
    api.install_error_handlers(app)
    app.add_middleware(api.BodyLimit, max_bytes=max_body_bytes, timeout_s=ops.body_timeout)
    ops.install(app, engine, APIError)   # keys, /metrics, timeouts, the page, and the admission queue
    server = OpenAIServer(engine, model_name, ops.admission)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/completions")(server.completions)
    responses_api.install(app, server.chat_completions)   # OpenAI's /v1/responses, for text, over chat
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model:path}")(server.model)
    app.get("/health")(server.health)
    if lora_dir is not None:
        if not ops.admin_key:   # every API key is a tenant
            raise ValueError("--lora-dir needs --admin-key: a tenant's key must not make the server read a path")
        adapter_routes.install_runtime_updates(app, engine, lora_dir, server.model_name)
    openapi_doc.document(app)
    return app
# --8<-- [end:make-app]


class OpenAIServer:
    """The request path: the endpoints, then prepare, then answers (admission and the engine)."""

    def __init__(self, engine: BaseOfflineEngine, model_name: str | None, admission: server_ops.AdmissionQueue):
        self.engine, self.admission = engine, admission
        self.can = engine.capabilities()   # what the engine says it does: read here, once
        self.model_name = model_name or self.can.model_name or type(engine).__name__
        self.context_length = self.can.context_length
        self.batching = self.can.schedules_itself   # Chapter 9: it schedules requests itself

    # --8<-- [start:chat-endpoint]
    async def chat_completions(self, req: ChatRequest, request: Request):
        lora = self.adapter_for(req)
        messages = api.chat_messages(req.messages)
        params = self.scoring(req)
        tools = params.structured is not None and params.structured[0] == "structural_tag"   # Chapter 11
        if tools:   # the model learns the functions from its system message
            messages = structured_api.with_tools(messages, req.tools)
        limit, field = req.token_limit()
        self.check_size([m["content"] for m in messages], "messages")   # before the template's work

        def prepare_chat() -> list:   # template and tokenizer: in a thread, not on the event loop
            if self.can.accepts_token_ids:   # ids, in which a client's text cannot spell control tokens
                prompt = api.chat_ids(self.engine.tokenizer, messages, render_chat)
            else:               # an engine that takes only text tokenises the template's text itself
                prompt = render_chat(self.engine.tokenizer, messages)
            return self.prepare([prompt], limit, field, params, lora)

        jobs = await run_in_threadpool(prepare_chat)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            if tools and params.n > 1:
                raise APIError(400, "a stream that may call tools takes n = 1", param="n")
            return await self.stream(jobs[0], params, req, request, rid, created, tools)
        [result] = await until_disconnected(request, self.generate(jobs, params))   # a hang-up stops it
        answer = api.chat_completion(rid, created, self.model_name, result, self.engine.tokenizer, tools)
        if req.prompt_logprobs is not None:   # vLLM's field, beside the choices as vLLM places it
            answer["prompt_logprobs"] = scoring_api.vllm_prompt_logprobs(result, self.engine.tokenizer, api._logprob)
        return answer
    # --8<-- [end:chat-endpoint]

    async def completions(self, req: CompletionRequest, request: Request):
        """A raw prompt, no chat template. A list of prompts is answered together, all or nothing."""
        single = isinstance(req.prompt, str) or (bool(req.prompt) and isinstance(req.prompt[0], int))
        prompts = [req.prompt] if single else req.prompt   # text, or token ids: one prompt, or a list of either
        if not prompts or not all(prompts):
            raise APIError(400, "prompt must be a non-empty string or list of token ids, or a list of them",
                           param="prompt")
        lora = self.adapter_for(req)
        if req.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes a single prompt", param="prompt")
        params = self.scoring(req)
        limit = 1 if req.max_tokens == 0 else req.max_tokens   # 0 (with echo): one token runs the prefill, dropped
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_size([prompt], "prompt")
            elif not all(0 <= t < len(self.engine.tokenizer) for t in prompt):   # token ids the model has
                raise APIError(400, f"prompt token ids must be in [0, {len(self.engine.tokenizer)})", param="prompt")
        jobs = await run_in_threadpool(self.prepare, prompts, limit, "max_tokens", params, lora)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return await self.stream(jobs[0], params, req, request, rid, created)
        results = await until_disconnected(request, self.generate(jobs, params))
        return api.text_completion(rid, created, self.model_name, results, self.engine.tokenizer,
                                   single=single, req=req, prompts=prompts)

    def scoring(self, req) -> SamplingParams:
        """The request's SamplingParams, once scoring a prompt (kit/scoring_api.py: echo, prompt_logprobs,
        max_tokens 0) is known to be servable by this engine."""
        try:
            scoring_api.check(req)
        except scoring_api.ScoringError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        params = api.sampling_params(req, SamplingParams, server_ops.tenant_salt)
        if params.prompt_logprobs is not None and not self.can.scores_prompts:
            raise APIError(400, "scoring a prompt (echo with logprobs, prompt_logprobs) is not supported by this "
                                "engine (the assembled engine, minivllm:LLM, has it)",
                           param="echo" if getattr(req, "echo", False) else "prompt_logprobs")
        return params

    # --8<-- [start:prepare]
    def check_size(self, texts: list[str], field: str) -> None:
        """Refuse text far too long for the context window before any tokenizer reads it: the
        tokenizer's time grows with the text, a refusal's must not."""
        chars, most = sum(map(len, texts)), (self.context_length or 0) * api.MAX_CHARS_PER_TOKEN
        if most and chars > most:
            raise APIError(400, f"the {field} text is {chars} characters; this model's maximum context length "
                                f"is {self.context_length} tokens, which this server takes to be at most {most} "
                                f"characters ({api.MAX_CHARS_PER_TOKEN} a token)", param=field)

    def adapter_for(self, req):
        """The request checked (api.check_request), and the LoRA adapter its `model` names (Chapter 17),
        None for the base model: every adapter the engine holds is served to every key."""
        adapters = {a.lora_name: a for a in self.engine.list_loras()} if self.can.serves_adapters else {}
        api.check_request(req, self.model_name, tuple(adapters))
        return adapters.get(req.model) if req.model != self.model_name else None

    def prepare(self, prompts: list, requested: int | None, field: str, params: SamplingParams,
                lora=None) -> list:
        """Each prompt (text, or a conversation's token ids) as the engine will take it, after every
        check that can refuse it: a bad prompt refuses a whole list before any of it runs. In a worker
        thread: tokenizers are slow.

        A batching engine gets the prompt's token ids, tokenised here once, in a request it has
        already validated (`new_request`). The others get the ids too where they take them
        (`accepts_token_ids`), else the text, each with its budget."""
        if requested is not None and self.context_length and requested > self.context_length:
            raise APIError(400, f"{field} is {requested}, but this model's maximum context "
                                f"length is {self.context_length} tokens.", param=field)
        api.check_engine_sampling(params, self.can.vllm_sampling)
        api.check_engine_answers(params, self.can.parallel_sampling)
        try:
            ids = [p if isinstance(p, list) else self.engine.tokenizer(p).input_ids for p in prompts]
            server_ops.prompt_read(sum(map(len, ids)))   # an answer cut short still counts its prompt
            server_ops.budget_set(sum(requested or self.default_budget(len(i)) for i in ids))   # its time bound
            if self.batching:
                adapter = {"lora_request": lora} if lora is not None else {}   # Chapter 17
                return [self.engine.new_request(i, requested or self.default_budget(len(i)), params, **adapter)
                        for i in ids]
            takes_ids = self.can.accepts_token_ids   # then tokenised once, here
            texts = [self.engine.tokenizer.decode(p) if isinstance(p, list) else p for p in prompts]
            jobs = [(i if takes_ids else p, requested or self.default_budget(len(i))) for p, i in zip(texts, ids)]
            if len(jobs) > 1 and self.can.checks_prompts:   # Chapter 1's checks: text, length, window
                for prompt, budget in jobs:
                    self.engine.encode(prompt, params.token_budget(budget))
            return jobs
        except Exception as exc:
            raise from_engine_error(exc) from exc

    def default_budget(self, n_prompt: int) -> int:
        """Without max_tokens: what is left of the context window, and of the KV pool where the
        engine has one (a small pool still answers a short prompt), at most 128."""
        budget = DEFAULT_MAX_TOKENS
        for limit in (self.context_length, self.can.token_capacity):
            if limit:
                budget = min(budget, limit - n_prompt)
        return max(1, budget)
    # --8<-- [end:prepare]

    # --8<-- [start:answer]
    @contextlib.asynccontextmanager
    async def answers(self, jobs: list, params: SamplingParams) -> AsyncIterator[list[AsyncIterator]]:
        """Each job's answer, read as it is produced: text pieces, then the GenerateResult.

        While the block is open the request holds its turn at the engine (the FIFO lock, or its
        seats in the batching engine's scheduler); leaving it early, a hang-up included, frees the work.
        """
        async with self.admission.turn(len(jobs) * params.num_sequences):   # n answers hold n seats
            if self.batching:   # in one go, so that they join the same step; no await since admission
                streams = self.engine.submit_all(jobs)
            else:
                streams = [self.pieces(prompt, budget, params) for prompt, budget in jobs]
            produced = [run_ahead(s) for s in streams]
            try:
                yield produced
            finally:
                with anyio.CancelScope(shield=True):   # a cancellation must not skip the clean-up
                    for p in produced:
                        await p.aclose()
                for s in streams:
                    s.close()   # also the ones nobody started reading
                # Ended before its results (a hang-up, a timeout, the shutdown): what it did generate
                # still counts. A batching engine's requests know; for the others, the pieces sent.
                server_ops.cut_short(sum(len(j.new_ids) for j in jobs) if self.batching else None)

    async def generate(self, jobs: list, params: SamplingParams) -> list:
        """Every job's GenerateResult, taken from its stream so that a hang-up stops it at the next token."""
        if not self.batching and len(jobs) > 1 and self.can.max_batch_size:
            results = await self.generate_in_batches(jobs, params)
            server_ops.answered(results)
            return results
        async with self.answers(jobs, params) as produced:
            try:   # a batching engine runs them all at once; the others run each as it is read
                results = (await all_or_nothing(last(p) for p in produced) if self.batching
                           else [await last(p) for p in produced])
            except Exception as exc:
                raise from_engine_error(exc) from exc
            # /metrics and the access log count what the engine reports; told before the block
            # ends, so that its clean-up knows the answers came back whole
            server_ops.answered(results)
        return results
    # --8<-- [end:answer]

    def pieces(self, prompt: str, max_tokens: int, params: SamplingParams) -> Iterator:
        """Text pieces then the GenerateResult, from generate_stream where the engine streams, else generate."""
        if self.can.streams:
            yield from self.engine.generate_stream(prompt, max_tokens, params)
            return
        result = self.engine.generate(prompt, max_tokens, params)
        if result.text:
            yield result.text
        yield result

    async def generate_in_batches(self, jobs: list, params: SamplingParams) -> list:
        """A list for an engine with batches of its own (Chapter 5's max_batch_size): generate_batch a
        batch at a time, each of prompts with the same budget, so that a hang-up or a timeout stops
        the list at the end of the running batch."""
        size, results = self.can.max_batch_size, {}
        async with self.admission.turn(len(jobs)):
            for budget in sorted({b for _, b in jobs}):
                rows = [i for i, (_, b) in enumerate(jobs) if b == budget]
                for chunk in (rows[k: k + size] for k in range(0, len(rows), size)):
                    try:
                        batch = await in_thread(self.engine.generate_batch, [jobs[i][0] for i in chunk], budget, params)
                    except Exception as exc:
                        raise from_engine_error(exc) from exc
                    results.update(zip(chunk, batch))
        return [results[i] for i in range(len(jobs))]

    # --8<-- [start:stream]
    async def stream(self, job, params: SamplingParams, req: ChatRequest | CompletionRequest, request: Request,
                     rid: str, created: int, tools: bool = False) -> StreamingResponse:
        chat, makers = isinstance(req, ChatRequest), {}

        def chunk(index: int = 0) -> Callable[..., dict]:   # each answer's own chunks (n > 1: Chapter 16)
            if index not in makers:
                makers[index] = api.chunk_maker("chat.completion.chunk" if chat else "text_completion", rid,
                                                created, chat, self.engine.tokenizer, self.model_name, index)
            return makers[index]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = self.events(job, params, chunk, chat, include_usage, structured_api.HoldBack() if tools else None)
        # Waits for the engine's turn and the first token (4xx if refused); a hang-up meanwhile cancels it.
        first = await until_disconnected(request, anext(events))

        async def body() -> AsyncIterator[str]:
            yield first
            async for event in events:
                yield event

        # aclose() runs the clean-up of `answers` even if the client left before the body was read.
        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(events.aclose))

    async def events(self, job, params: SamplingParams, chunk: Callable[[int], Callable[..., dict]], chat: bool,
                     include_usage: bool, hold: structured_api.HoldBack | None = None) -> AsyncIterator[str]:
        """Server-sent events: text as the engine produces it, holding the request's turn for the whole stream.
        hold: the request offered tools, so text that may be a call waits until the end."""
        async with self.answers([job], params) as [produced]:
            try:  # before the first event an error can still be a proper 4xx response
                item = await anext(produced, None)
            except Exception as exc:
                raise from_engine_error(exc) from exc
            if chat:
                for i in range(params.n):
                    yield sse(chunk(i)({"role": "assistant", "content": ""}))
            try:
                while isinstance(item, str):
                    server_ops.piece_sent()
                    piece = hold.feed(item) if hold else item
                    if piece or not hold:
                        yield sse(chunk(piece_index(item))({"content": piece} if chat else piece))
                    item = await anext(produced, None)
                if item is None:
                    raise RuntimeError("the engine's stream ended without a GenerateResult")
            except Exception as exc:  # too late for a status code: report it in the stream
                error = from_engine_error(exc)
                server_ops.failed(error.message, error.status)
                yield sse(error.body())
                yield sse("[DONE]")
                return
            server_ops.answered([item])
            finish = item.finish_reason
            if hold:   # the call, whole, as OpenAI streams one: id and name, then the arguments
                call = structured_api.parse_tool_call(hold.text)
                if call:
                    fn = call[1]["function"]
                    yield sse(chunk()({"tool_calls": [{"index": 0, "id": call[1]["id"], "type": "function",
                                                       "function": {"name": fn["name"], "arguments": ""}}]}))
                    yield sse(chunk()({"tool_calls": [{"index": 0, "function": {"arguments": fn["arguments"]}}]}))
                    finish = "tool_calls"
                elif rest := hold.rest(cut_short=finish == "length"):
                    yield sse(chunk()({"content": rest}))
            for i, answer in enumerate(item.outputs):   # each answer's last chunk: its finish_reason
                final = chunk(i)({} if chat else "", finish if i == 0 else answer.finish_reason, result=answer)
                if i == len(item.outputs) - 1:
                    final["metrics"] = item.metrics.as_dict()   # non-standard, like the non-streamed reply
                yield sse(final)
            if include_usage:
                yield sse({**chunk()({}), "choices": [], "usage": api.usage([item])})
            yield sse("[DONE]")
    # --8<-- [end:stream]

    # --8<-- [start:small-endpoints]
    async def models(self):
        """The base model, then each LoRA adapter the engine holds (Chapter 17), its parent the base."""
        adapters = self.engine.list_loras() if self.can.serves_adapters else []
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "llm-engine-companion"},
            *({"id": a.lora_name, "object": "model", "created": 0, "owned_by": "llm-engine-companion",
               "parent": self.model_name, "root": str(a.lora_path)} for a in adapters)]}

    async def model(self, model: str):
        """GET /v1/models/{id} (client.models.retrieve): the base or one of its adapters, or OpenAI's 404."""
        for card in (await self.models())["data"]:
            if card["id"] == model:
                return card
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                       param="model", code="model_not_found")

    async def health(self):
        broken = self.engine.unavailable()   # Chapter 14: a rank died; the process ends in seconds
        if broken:
            raise APIError(503, f"the engine is unavailable: {broken}", type_="server_error")
        return {"status": "ok"}
    # --8<-- [end:small-endpoints]


async def last(produced: AsyncIterator):
    """The GenerateResult that ends an answer's stream."""
    async for item in produced:
        if not isinstance(item, str):
            return item
    raise RuntimeError("the engine's stream ended without a GenerateResult")


# --8<-- [start:uvicorn-app]
def create_app() -> FastAPI:
    """For `uvicorn --factory 05_server:create_app`: the engine named by ENGINE_CLASS and
    ENGINE_MODEL (default: Chapter 1's) behind the API, keyed by ENGINE_API_KEY if set.
    ENGINE_CLASS is a spec as --engine takes it, flags included ("minivllm:LLM --quant int8").

    uvicorn calls the factory once as it starts, before it opens its socket: a model that fails
    to load stops the server there, with its error, and importing 05_server (the tests build
    apps around tiny engines) loads no model."""
    engine = load_engine(os.environ.get("ENGINE_CLASS", DEFAULT_ENGINE), os.environ.get("ENGINE_MODEL"))
    ops = server_ops.ServerOps(api_key=os.environ.get("ENGINE_API_KEY") or None,
                               metrics_key=os.environ.get("ENGINE_METRICS_KEY") or None,
                               admin_key=os.environ.get("ENGINE_ADMIN_KEY") or None)
    return make_app(engine, ops=ops)
# --8<-- [end:uvicorn-app]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Serve an engine over OpenAI's HTTP API.")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 exposes it to the network")
    parser.add_argument("--port", type=cli.integer(1, 65535), default=8001)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    parser.add_argument("--model", default=os.environ.get("ENGINE_MODEL"),
                        help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's id in the API (vLLM's flag; default: the engine's model name)")
    parser.add_argument("--engine", default=os.environ.get("ENGINE_CLASS", DEFAULT_ENGINE),
                        help="the engine class as module:Class (default: $ENGINE_CLASS or %(default)s); "
                        "flags after the class, in the same quotes, are its own and win over the ones "
                        "below: \"16_quantization_engine:QuantizedEngine --quant int4\"")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    cli.add_engine_options(parser)   # --quant, --prefix-caching, --kv-memory, ...: the engine's keywords
    server_ops.add_arguments(parser)
    replica_server.add_arguments(parser)
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters served by name (vLLM's flag; needs --enable-lora)")
    parser.add_argument("--lora-dir", default=None, metavar="DIR",
                        help="turns on POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime "
                        "routes), for the --admin-key only, reading adapters only under DIR")
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    if not args.host.strip():   # '' would listen on every interface, not on none
        parser.error("--host must name an address: 127.0.0.1 (this machine only) or 0.0.0.0 (the network)")
    if args.model_tag is not None:   # `minivllm-serve MODEL`, as `vllm serve MODEL`
        if args.model not in (None, args.model_tag) and "--model" in " ".join(sys.argv):
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    try:
        ops = server_ops.ServerOps.from_args(args)   # bad values fail before the model loads
        if args.replicas is None:
            engine = load_engine(args.engine, args.model, device=args.device, **cli.engine_options(args))
            adapter_routes.add_lora_modules(engine, args.lora_modules)
        else:   # Chapter 18: the same app in front of N engines on Ray Serve
            if args.lora_dir is not None:
                raise ValueError("--lora-dir does not combine with --replicas yet: each replica would load on its own")
            engine = replica_server.start(args, cli.engine_options(args))
        app = make_app(engine, args.served_model_name, ops=ops, lora_dir=args.lora_dir)
    except ValueError as exc:
        parser.error(str(exc))
    print(server_ops.startup_lines(args.engine, args.host, args.port, ops.api_key), flush=True)   # URLs for the class
    try:
        server_ops.run_server(app, ops, host=args.host, port=args.port)
    finally:   # the engine's loop thread and worker processes end with the server
        engine.close()


if __name__ == "__main__":
    main()
