"""07_decode_loop.py - Chapter 2: open the black box and write the token loop ourselves.

Chapter 1's engine called `model.generate` and got tokens back. Inside that call is
a loop with two phases, and this script writes it out:

    prefill      run the whole prompt through the model once, keeping every layer's
                 keys and values in a KV cache; the last position's logits give token 1
    decode step  feed only the newest token; it attends to the cached keys/values
                 and appends its own, and its logits give the next token

Each step's logits go through Chapter 1's `sample_next_token` (02_sampling.py); the loop stops on EOS,
on a stop string or at the token budget. Because we own the loop we can finally
time it: TTFT (time to first token: mostly prefill) and TPOT (time per output token
after that: the decode pace).

    python 07_decode_loop.py
    python 07_decode_loop.py --stream --prompt "Write a haiku about caches."
    python 07_decode_loop.py --temperature 0.8 --top-p 0.9 --seed 1
    python 07_decode_loop.py --compare 3     # tokens/s against HF generate, same model
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import time
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from kit import cli
from kit.demo import demo, demo_parser
from kit.hf import cache_keyword
from kit.workloads import reference_prompts
from minivllm.contracts import GenerateResult, SamplingParams
from minivllm.output import OutputProcessor, Request, sample

engine04 = importlib.import_module("04_engine")


class DecodeLoopEngine(engine04.BaselineEngine):
    """Chapter 2: the same interface and results as BaselineEngine, with our own loop inside."""

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, structured_output=None):
        super().__init__(model_name, device, dtype, structured_output)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.vocab_size, self.device,
                                      structured_output)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = cache_keyword(type(self.model))
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    # --8<-- [start:prefill]
    @torch.inference_mode()  # no autograd bookkeeping at all, a little cheaper than no_grad
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
        """All prompt tokens in one forward pass; returns the last position's logits and the KV cache."""
        cache = DynamicCache(config=self.model.config)   # filled in place, layer by layer
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kw: cache},
                         **self._keep_last)                 # only the last position predicts: skip the rest
        return out.logits[:, -1, :], cache
    # --8<-- [end:prefill]

    # --8<-- [start:decode-step]
    @torch.inference_mode()
    def decode_step(self, token_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """One new token per row ([batch, 1]); it attends to the cache and appends its own K/V."""
        out = self.model(input_ids=token_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kw: cache})
        return out.logits[:, -1, :]
    # --8<-- [end:decode-step]

    # --8<-- [start:loop]
    def decode_loop(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor, seqs: list[Request]) -> Iterator[list[str]]:
        """Prefill, then one decode step per token until every row is done.

        Works on [batch, seq] tensors: row i of input_ids belongs to request seqs[i]. attention_mask
        is None when no row is padded. Yields, after every step, each row's new text piece
        ("" for a row that is already finished: it rides along until the batch is done).
        """
        logits, cache = self.prefill(input_ids, attention_mask, position_ids)
        next_position = position_ids[:, -1:] + 1
        while True:
            tokens = sample(logits, seqs)
            now = time.perf_counter()         # the token is ready: sample() synchronised the device
            yield [self.output.accept(s, t, now) if s.finish_reason is None else "" for s, t in zip(seqs, tokens)]
            if all(s.finish_reason for s in seqs):
                return
            if attention_mask is not None:    # the new column is real for every row
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(seqs), 1)], dim=1)
            step_ids = torch.tensor(tokens, device=input_ids.device).unsqueeze(1)
            logits = self.decode_step(step_ids, attention_mask, next_position, cache)
            next_position = next_position + 1
    # --8<-- [end:loop]

    # --8<-- [start:stream]
    def generate_stream(self, prompt: str, max_new_tokens: int,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        """Yield text pieces as tokens are produced, then the GenerateResult.

        No thread needed: the loop is a generator, so it only runs while someone reads,
        and closing this iterator early stops the work at the next token.
        """
        t0 = time.perf_counter()
        params = SamplingParams.or_default(params)
        budget = params.token_budget(max_new_tokens)
        input_ids = self.encode(prompt, budget)
        request = self.output.new_request(input_ids[0].tolist(), params, budget, arrival=t0)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        with contextlib.closing(self.decode_loop(input_ids, None, positions, [request])) as loop:
            for (piece,) in loop:
                if piece:
                    yield piece
        yield self.output.result(request)

    def generate(self, prompt: str, max_new_tokens: int,
                 params: SamplingParams | None = None) -> GenerateResult:
        *_, result = self.generate_stream(prompt, max_new_tokens, params)   # the same loop, drained
        return result
    # --8<-- [end:stream]


def compare_with_generate(engine: DecodeLoopEngine, prompts: list[str], new_tokens: int,
                          reps: int) -> tuple[float, float]:
    """Tokens/s of HF generate and of our loop on the same model object, alternating repetitions."""
    params = SamplingParams(ignore_eos=True)
    timings = {"generate": 0.0, "loop": 0.0}
    hf_generate = engine04.BaselineEngine.generate   # Chapter 1's method, called on this very model
    for _ in range(reps):
        for prompt in prompts:
            for name, fn in (("generate", hf_generate), ("loop", DecodeLoopEngine.generate)):
                t = time.perf_counter()
                fn(engine, prompt, new_tokens, params)
                timings[name] += time.perf_counter() - t
    total = reps * len(prompts) * new_tokens
    return total / timings["generate"], total / timings["loop"]


def main() -> None:
    parser = demo_parser("Chapter 2: our own prefill + decode loop.")
    parser.add_argument("--stream", action="store_true", help="then stream the answer token by token")
    parser.add_argument("--compare", type=cli.integer(0, 100), default=0, metavar="REPS",
                        help="time HF generate vs this loop (64 tokens, ignore_eos, REPS rounds)")
    args = parser.parse_args()
    engine, prompt, params = demo(DecodeLoopEngine, args)

    if args.stream:
        # --8<-- [start:stream-demo]
        print("\n[Streaming]\n  ", end="", flush=True)
        for item in engine.generate_stream(prompt, args.max_new_tokens, params):
            if isinstance(item, str):
                print(item, end="", flush=True)   # each piece as soon as its token exists
        print(f"\n  ({item.metrics.output_tokens} tokens, TTFT {item.metrics.ttft_ms:.0f} ms)")
        # --8<-- [end:stream-demo]

    if args.compare:
        prompts = reference_prompts()[:4]
        hf, ours = compare_with_generate(engine, prompts, 64, args.compare)
        print(f"\n[Speed, batch 1, 64 new tokens, {len(prompts)} prompts x {args.compare} rounds, alternating]")
        print(f"  HF generate  {hf:6.1f} tokens/s\n  our loop     {ours:6.1f} tokens/s\n  ratio        {ours / hf:6.3f}")


if __name__ == "__main__":
    main()
