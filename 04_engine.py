"""04_engine.py - the interface every chapter keeps, and the Chapter 1 engine behind it.

`BaseOfflineEngine` is the contract: a prompt in, a `GenerateResult` out, one
request or a list. `BaselineEngine` fulfils it with HuggingFace's `model.generate`,
which hides the whole token loop in one call; Chapter 2 opens that box.

    python 04_engine.py
    python 04_engine.py --prompt "Write a haiku about GPUs." --temperature 0.8 --seed 1
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from kit.demo import engine_main
from minivllm import threads as cpu_threads
from minivllm import contracts, model_files
from minivllm.contracts import BaseOfflineEngine, GenerateResult, RequestMetrics, SamplingParams
from minivllm.text import IncrementalDetokenizer, attach_logprobs, tokenize

hf_hooks = importlib.import_module("04_hf_hooks")   # how HF's generate honours SamplingParams


class BaselineEngine(BaseOfflineEngine):
    """Chapter 1: HuggingFace's generate() behind our interface. A black box, but correct."""

    # --8<-- [start:capabilities]
    def capabilities(self) -> contracts.EngineCapabilities:
        """It streams (HF's streamer), takes a prompt as token ids (minivllm/text.py: tokenize) and
        refuses a bad one before any work (encode)."""
        return super().capabilities().replace(model_name=self.model_name, device=str(self.device),
                                              context_length=self.context_length, streams=True,
                                              accepts_token_ids=True, checks_prompts=True)
    # --8<-- [end:capabilities]

    # --8<-- [start:init]
    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, structured_output=None):
        self.model_name = model_name or os.environ.get(model_files.MODEL_ENV_VAR) or model_files.DEFAULT_MODEL
        self.device = model_files.pick_device(device)
        self.structured_output = structured_output   # Chapter 11's grammars, when whoever builds us passes them
        print(f"[engine] loading {self.model_name} on {self.device} ...", flush=True)
        self.tokenizer, self.model = model_files.load_hf_model(model_name, self.device, dtype)
        self.context_length = int(self.model.config.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        print("[engine] ready", flush=True)
    # --8<-- [end:init]

    @property
    def vocab_size(self) -> int:
        """Width of the logits: the token ids a logit_bias may name."""
        return int(self.model.config.vocab_size)

    def _eos_ids(self) -> set[int]:
        return model_files.merge_eos(self.model.generation_config.eos_token_id, self.tokenizer)

    # --8<-- [start:encode]
    def encode(self, prompt: str | list[int], max_new_tokens: int) -> torch.Tensor:
        """Tokenize one prompt (or take its ids) onto the device, refusing requests the model cannot serve."""
        ids = tokenize(self.tokenizer, prompt, max_new_tokens, self.context_length, self.vocab_size)
        return torch.tensor([ids], device=self.device)
    # --8<-- [end:encode]

    # --8<-- [start:generation-config]
    def _generation_config(self, params: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        """Translate SamplingParams into HF's vocabulary, starting from a clean config."""
        base = self.model.generation_config
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            bos_token_id=base.bos_token_id,
            pad_token_id=base.pad_token_id if base.pad_token_id is not None else self.tokenizer.eos_token_id,
            eos_token_id=sorted(self.eos_token_ids) if params.stops_on_eos else [],  # [] = never stop on EOS
        )
        if params.is_greedy:
            config.do_sample = False
        else:
            config.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k)  # top_k=0 means off for HF too
        return config

    def _logits_processors(self, params: SamplingParams, n_prompt: int,
                           recorder: hf_hooks.RawLogprobs | None = None) -> LogitsProcessorList:
        """Bias and penalties as HF processors, in HF's own order; generate adds temperature,
        top-k and top-p after them. HF does the bias and the repetition penalty itself."""
        params.check_vocab(self.vocab_size)
        processors = [recorder] if recorder else []
        if params.logit_bias:
            processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
        if params.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
        if params.presence_penalty or params.frequency_penalty:
            processors.append(hf_hooks.OutputPenalties(params, n_prompt))
        if params.structured is not None:   # Chapter 11's grammar, last: it only removes tokens
            if self.structured_output is None:
                raise ValueError(contracts.NO_STRUCTURED_OUTPUT)
            processors.append(self.structured_output.hf_processor(
                self.tokenizer, self.vocab_size, self.eos_token_ids, params.structured))
        return LogitsProcessorList(processors)
    # --8<-- [end:generation-config]

    # --8<-- [start:finish]
    def finish(self, new_ids: list[int], params: SamplingParams, n_prompt: int, elapsed_s: float,
               detok: IncrementalDetokenizer | None = None,
               logprobs: list | None = None) -> GenerateResult:
        """Build the result shared by every engine: text cut at a stop string, honest metrics.

        A streaming caller passes the detokenizer that already saw every id, so the text
        is not decoded a second time.
        """
        if detok is None:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop)
            for token_id in new_ids:
                detok.add(token_id)
                if detok.stopped:
                    break
        ended_on_eos = bool(new_ids) and new_ids[-1] in self.eos_token_ids and params.stops_on_eos
        return GenerateResult(
            text=detok.text,
            output_ids=list(new_ids),
            metrics=RequestMetrics(
                throughput=len(new_ids) / max(elapsed_s, 1e-9),
                input_tokens=n_prompt,
                output_tokens=len(new_ids),
            ),
            finish_reason="stop" if (detok.stopped or ended_on_eos) else "length",
            logprobs=None if logprobs is None else   # those of the text returned, not of a stop string's tokens
            list(logprobs[: detok.tokens_in_text if detok.stopped else len(new_ids)]),
        )
    # --8<-- [end:finish]

    # --8<-- [start:generate]
    def generate(self, prompt: str, max_new_tokens: int,
                 params: SamplingParams | None = None) -> GenerateResult:
        params = SamplingParams.or_default(params)   # no params: greedy
        max_new_tokens = params.token_budget(max_new_tokens)
        input_ids = self.encode(prompt, max_new_tokens)
        if params.seed is not None:
            torch.manual_seed(params.seed)           # HF samples from torch's global generator: one
                                                     # request at a time keeps this reproducible

        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        recorder = None if params.logprobs is None else hf_hooks.RawLogprobs(params.logprobs)
        streamer = hf_hooks.TokenQueueStreamer(recorder) if recorder else None   # pairs tokens with logprobs
        t0 = time.perf_counter()
        with torch.no_grad():                        # generate() is no_grad already; our own loops need it
            # Chapter 2 replaces this call with our own token-by-token loop.
            output_ids = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=self._generation_config(params, max_new_tokens),
                logits_processor=self._logits_processors(params, input_ids.shape[1], recorder),
                stopping_criteria=StoppingCriteriaList(
                    [hf_hooks.StopTextCriteria(detok, input_ids.shape[1])] if params.stop else []),
                streamer=streamer,
            )
        elapsed_s = time.perf_counter() - t0

        new_ids = output_ids[0, input_ids.shape[1]:].tolist()   # drop the prompt
        return self.finish(new_ids, params, input_ids.shape[1], elapsed_s, detok if params.stop else None,
                           streamer.logprobs if streamer else None)

    def generate_batch(self, prompts: list[str], max_new_tokens: int,
                       params: SamplingParams | None = None) -> list[GenerateResult]:
        # One after another: correct, but the hardware idles. Chapter 5 batches them.
        contracts.check_prompts(prompts)
        budget = SamplingParams.or_default(params).token_budget(max_new_tokens)
        for p in prompts:          # refuse bad input before any work: all of the list or none
            self.encode(p, budget)
        return [self.generate(p, max_new_tokens, params) for p in prompts]
    # --8<-- [end:generate]

    # --8<-- [start:stream]
    def generate_stream(self, prompt: str, max_new_tokens: int,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        """Yield text pieces as HF produces them, then the final GenerateResult.

        generate() runs in a worker thread and hands us tokens through a streamer.
        Closing this iterator early (a client hung up) stops that thread too.
        """
        params = SamplingParams.or_default(params)
        max_new_tokens = params.token_budget(max_new_tokens)
        input_ids = self.encode(prompt, max_new_tokens)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        recorder = None if params.logprobs is None else hf_hooks.RawLogprobs(params.logprobs)
        processors = self._logits_processors(params, input_ids.shape[1], recorder)
        streamer, cancel, failure = hf_hooks.TokenQueueStreamer(recorder), threading.Event(), []

        def run() -> None:
            try:
                with torch.no_grad():
                    self.model.generate(
                        input_ids, attention_mask=torch.ones_like(input_ids),
                        generation_config=self._generation_config(params, max_new_tokens),
                        logits_processor=processors, streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([hf_hooks.CancelCriteria(cancel)]))
            except Exception as exc:  # handed to the consumer: a failure must not look like a short answer
                failure.append(exc)
            finally:
                streamer.end()

        t0 = time.perf_counter()
        worker = threading.Thread(target=run, daemon=True)
        cpu_threads.release_idle_workers()   # the worker computes; this thread's idle CPU workers go
        worker.start()
        detok, new_ids, sent = IncrementalDetokenizer(self.tokenizer, params.stop), [], 0

        def read_logprobs():   # only the tokens read so far: HF's thread may have recorded the next one's
            return streamer.logprobs and streamer.logprobs[:len(new_ids)]

        try:
            while (token_id := streamer.tokens.get()) is not None:
                new_ids.append(token_id)
                piece, sent = attach_logprobs(detok.add(token_id), read_logprobs(), sent)
                if piece:
                    yield piece
                if detok.stopped:  # the stop string is complete: nothing after it is wanted
                    break
            piece, sent = attach_logprobs(detok.flush(), read_logprobs(), sent)
            if piece:
                yield piece
        finally:
            cancel.set()
            worker.join()
        if failure:
            raise failure[0]
        yield self.finish(new_ids, params, input_ids.shape[1], time.perf_counter() - t0, detok, streamer.logprobs)
    # --8<-- [end:stream]


def main() -> None:
    # 128 new tokens, not the shared 48: the default answer (91 tokens) ends where the model ends it
    engine_main(BaselineEngine, "Run the Chapter 1 baseline engine once.", max_new_tokens=128)


if __name__ == "__main__":
    main()
