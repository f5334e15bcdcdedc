"""10_model_engine.py - Chapter 6's engine: Chapter 2's decode loop, on the model we own.

The engine is three parts, each from its own chapter, composed:

    tokenizer + output processor   text in, text out (Chapters 1 and 2: 07_decode_loop.py)
    model runner                   weights + KV storage + one step (10_model_runner.py)
    the loop                       which requests feed which tokens, step after step (here)

Because the model takes ragged batches, `generate_batch` needs no padding: every prompt
goes through one prefill forward, and afterwards only the requests still running join
each decode step. Each request owns one contiguous row of the KV cache, sized for its
longest possible life; Chapter 7 replaces rows by blocks.

    python 10_model_engine.py                                    # one prompt, as 04_engine.py
    python 06_benchmark_offline.py --engine 04_engine:BaselineEngine --engine 10_model_engine:ModelEngine
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from kit.demo import engine_main
from minivllm.contracts import BaseOfflineEngine, GenerateResult, SamplingParams, check_prompts, is_integer
from minivllm.model_files import DEFAULT_MODEL, eos_token_ids, load_tokenizer, model_folder, pick_device, pick_dtype
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import OutputProcessor, Request

DEFAULT_KV_MEMORY = 2 << 30   # bytes of KV cache one generate_batch chunk may allocate (rows, not blocks)


class ModelEngine(BaseOfflineEngine):
    """Chapter 6: tokenizer + output processor + model runner, and the decode loop that drives them."""

    def capabilities(self):
        """It streams, takes a prompt as token ids (minivllm/text.py: tokenize) and runs
        max_num_seqs prompts of a list together."""
        return super().capabilities().replace(model_name=self.model_name, device=str(self.device),
                                              context_length=self.context_length, streams=True,
                                              accepts_token_ids=True, max_batch_size=self.max_num_seqs)

    # --8<-- [start:init]
    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, max_num_seqs: int = 32,
                 kv_memory: int = DEFAULT_KV_MEMORY, weight_steps: Sequence = (), structured_output=None):
        for name, value in (("max_num_seqs", max_num_seqs), ("kv_memory", kv_memory)):
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model_name = model_name or DEFAULT_MODEL
        self.device = pick_device(device)
        self.folder = model_folder(model_name)
        print(f"[engine] loading {self.model_name} into LlamaModel on {self.device} ...", flush=True)
        self.tokenizer = load_tokenizer(self.folder)
        # weight_steps: what happens to the weights once read (a format of Chapter 12, say)
        model = load_model(self.folder, pick_dtype(dtype, self.device), self.device, weight_steps)
        self.runner = ModelRunner(model, kv=None)   # Chapter 6: a KV cache per batch, made in run()
        self.output = OutputProcessor(self.tokenizer, eos_token_ids(self.folder, self.tokenizer),
                                      model.config.vocab_size, self.device, structured_output)
        self.context_length = model.config.max_position_embeddings
        self.max_num_seqs, self.kv_memory = max_num_seqs, kv_memory
        self.quant = model.format_name   # None: the model's own float weights
        if self.quant:
            print(f"[engine] weights: {self.quant}, {model.weight_bytes / 1e6:.0f} MB", flush=True)
        print("[engine] ready", flush=True)
    # --8<-- [end:init]

    @property
    def model(self):
        return self.runner.model

    @property
    def max_batch_size(self) -> int:
        """How many prompts one generate_batch call runs together (the server chunks lists by it)."""
        return self.max_num_seqs

    def features(self) -> dict:
        """What this engine was built with, for the server's page and /metrics."""
        return {"engine": type(self).__name__, "quant": self.quant or "float32", "max_num_seqs": self.max_num_seqs,
                "compile": getattr(self.model, "compiled", False)}

    # --8<-- [start:new-request]
    def new_request(self, prompt: str | list[int], max_new_tokens: int,
                    params: SamplingParams | None = None, arrival: float | None = None) -> Request:
        """Check and tokenise now, in the caller's thread: a bad request never reaches the loop.
        A list of token ids is taken as tokenised already (the server tokenises once)."""
        return self.output.request_for(prompt, max_new_tokens, params, self.context_length, arrival)
    # --8<-- [end:new-request]

    # --8<-- [start:run]
    def run(self, requests: list[Request]) -> Iterator[list[str]]:
        """Prefill every prompt in one ragged forward, then decode the live requests together.

        Request i owns cache row i. Yields, after every step, each request's new text ("" for
        a finished one). A finished request leaves at once: its row is simply not in the next
        step's batch, so nobody computes tokens it does not want.
        """
        rows = {r.id: i for i, r in enumerate(requests)}
        self.runner.kv = self.model.new_cache(len(requests), max(r.n_prompt + r.budget for r in requests))
        live = list(requests)
        while live:
            starts = [r.num_computed for r in live]
            lengths = [r.num_tokens - r.num_computed for r in live]   # the prompt, then 1 a step
            tokens = self.runner.step(live, starts, lengths, [rows[r.id] for r in live])
            now, pieces = time.perf_counter(), {}
            for r, token in zip(live, tokens):
                r.num_computed = r.num_tokens
                pieces[r.id] = self.output.accept(r, token, now)
            yield [pieces.get(r.id, "") for r in requests]
            live = [r for r in live if r.finish_reason is None]
    # --8<-- [end:run]

    # --8<-- [start:generate]
    def generate_stream(self, prompt: str, max_new_tokens: int,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        request = self.new_request(prompt, max_new_tokens, params, arrival=time.perf_counter())
        loop = self.run([request])
        try:
            for (piece,) in loop:
                if piece:
                    yield piece
        finally:
            loop.close()       # a caller that stops reading stops the work at the next token
        yield self.output.result(request)

    def generate(self, prompt: str, max_new_tokens: int, params: SamplingParams | None = None) -> GenerateResult:
        *_, result = self.generate_stream(prompt, max_new_tokens, params)
        return result

    def generate_batch(self, prompts: list[str], max_new_tokens: int,
                       params: SamplingParams | None = None) -> list[GenerateResult]:
        check_prompts(prompts)
        t0 = time.perf_counter()           # every request was submitted now: TTFT counts from here
        requests = [self.new_request(p, max_new_tokens, params, arrival=t0) for p in prompts]  # all checked first
        for chunk in self.batch_chunks(requests):
            for _ in self.run(requests[chunk]):
                pass
        return [self.output.result(r) for r in requests]

    def batch_chunks(self, requests: list[Request]) -> Iterator[slice]:
        """Consecutive requests whose contiguous KV rows (longest prompt + budget each) fit in kv_memory."""
        per_token = self.model.config.kv_bytes_per_token(self.model.dtype)
        row = lambda r: r.n_prompt + r.budget   # noqa: E731
        start = 0
        while start < len(requests):
            end = start + 1
            while (end < len(requests) and end - start < self.max_num_seqs
                   and (end + 1 - start) * max(map(row, requests[start:end + 1])) * per_token <= self.kv_memory):
                end += 1
            yield slice(start, end)
            start = end
    # --8<-- [end:generate]


def main() -> None:
    engine_main(ModelEngine, "Chapter 6: the decode loop on a Llama we wrote ourselves.")


if __name__ == "__main__":
    main()
