"""04_engine.py - the interface every chapter keeps, and the Chapter 1 engine behind it.

`BaseOfflineEngine` is the contract: a prompt in, a `GenerateResult` out, one
request or a list. `BaselineEngine` fulfils it with HuggingFace's `model.generate`,
which hides the whole token loop in one call; Chapter 2 opens that box.

    python 04_engine.py
    python 04_engine.py --prompt "Write a haiku about GPUs." --temperature 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import threading
import time
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from kit import cli
from minivllm import threads as cpu_threads
from kit.engines import load_engine  # noqa: F401  (how the server and benchmarks build any engine)
from minivllm import contracts, model_files
from minivllm.contracts import BaseOfflineEngine, GenerateResult, RequestMetrics, SamplingParams
from minivllm.text import IncrementalDetokenizer, attach_logprobs, render_chat, tokenize  # noqa: F401

setup = importlib.import_module("01_setup")
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




def reference_prompts() -> list[str]:
    """The committed prompts on which every engine must match the baseline token for token."""
    path = setup.REPO_ROOT / "data" / "reference_prompts.json"
    return json.loads(path.read_text())["prompts"]




def demo_parser(description: str) -> argparse.ArgumentParser:
    """The command-line flags every engine script shares (later chapters add their own)."""
    parser = argparse.ArgumentParser(description=description)
    cli.add_model_flags(parser)
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the answer's budget in tokens (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=model_files.DTYPE_NAMES,
                        help="weights' precision (default auto: bfloat16 on a GPU, float32 elsewhere)")
    return parser


# --8<-- [start:main]
# The unit of each number RequestMetrics can carry: a bare "3.2" could be seconds or tokens/s.
METRIC_UNITS = {"throughput": "tokens/s", "input_tokens": "tokens", "output_tokens": "tokens",
                "ttft_ms": "ms", "tpot_ms": "ms", "queue_ms": "ms", "cached_tokens": "tokens",
                "draft_tokens": "tokens", "accepted_tokens": "tokens"}


def metric_lines(metrics) -> list[str]:
    """One '  name  value unit' line per measured metric (what was not measured is left out)."""
    lines = []
    for name, value in metrics.as_dict().items():
        if name not in METRIC_UNITS:
            raise ValueError(f"metric {name!r} has no unit: add it to METRIC_UNITS")
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        lines.append(f"  {name:<15} {shown} {METRIC_UNITS[name]}")
    return lines


def print_streamed(pieces, indent: str = "  ") -> object:
    """Print text pieces as they arrive, indented like the other blocks, and return what followed
    them (the GenerateResult). Leading and trailing whitespace is held back, as strip() would:
    trailing spaces are printed only once more text follows them."""
    pending, started, result = "", False, None
    print(indent, end="", flush=True)
    for piece in pieces:
        if not isinstance(piece, str):
            result = piece
            continue
        text = pending + piece
        if not started:
            text = text.lstrip()
        body = text.rstrip()
        pending = text[len(body):]
        if body:
            started = True
            print(body.replace("\n", "\n" + indent), end="", flush=True)
    print()
    return result


def demo(engine_class: type[BaseOfflineEngine], args: argparse.Namespace, **engine_kwargs):
    """Build the engine, send one request, print [Prompt], [Output] (streamed as it is generated,
    where the engine can stream) and [Metrics]. engine_kwargs: the engine's own features."""
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        engine = engine_class(args.model, device=args.device, dtype=args.dtype, **engine_kwargs)
        prompt = args.prompt if args.raw else render_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
        print(f"\n[Prompt]\n  {args.prompt}" + ("" if args.raw else "   (sent through the chat template)"))
        print("\n[Output]")
        if hasattr(engine, "generate_stream"):   # a reader sees the answer grow, not a silent wait
            result = print_streamed(engine.generate_stream(prompt, args.max_new_tokens, params))
        else:
            result = engine.generate(prompt, args.max_new_tokens, params)
            print(f"  {result.text.strip()}")
    except (ValueError, OSError) as exc:  # bad flags or a model that cannot be found: say so, no traceback
        raise SystemExit(f"error: {exc}") from None

    print("\n[Metrics]")
    print("\n".join(metric_lines(result.metrics)))
    print(f"  {'finish_reason':<15} {result.finish_reason}")
    return engine, prompt, params
# --8<-- [end:main]


def engine_main(engine_class: type[BaseOfflineEngine], description: str, **defaults):
    """An engine script's main(): the shared flags, plus a flag for each feature the engine's
    constructor takes (kit/cli.py's engine options), then one request through demo().
    defaults: features switched on unless the command line says otherwise."""
    parser = demo_parser(description)
    takes = inspect.signature(engine_class).parameters
    cli.add_engine_options(parser, only=tuple(name for name in cli.ENGINE_OPTIONS   # --dtype: demo_parser's
                                              if name in takes and name != "dtype"))
    parser.set_defaults(**defaults)
    args = parser.parse_args()
    features = {name: value for name, value in cli.engine_options(args).items() if name != "dtype"}  # demo's own
    return demo(engine_class, args, **features)


def main() -> None:
    # 128 new tokens, not the shared 48: the default answer (91 tokens) ends where the model ends it
    engine_main(BaselineEngine, "Run the Chapter 1 baseline engine once.", max_new_tokens=128)


if __name__ == "__main__":
    main()
