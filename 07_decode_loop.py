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
import functools
import importlib
import inspect
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kit import cli, plugins

sampling = importlib.import_module("02_sampling")
contracts = importlib.import_module("03_contracts")
engine04 = importlib.import_module("04_engine")
SamplingParams, GenerateResult = contracts.SamplingParams, contracts.GenerateResult


# --8<-- [start:request]
@dataclass(eq=False)
class Request:
    """One request, from its prompt's token ids to its result: the one object that every engine,
    the scheduler (Chapter 9) and the block manager (Chapter 7, by id) pass around."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    budget: int                                   # new tokens it may produce
    detok: engine04.IncrementalDetokenizer        # text so far, and whether a stop string appeared
    generator: torch.Generator | None             # private seeded stream (None: torch's global one)
    new_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None              # None while still running
    arrival: float = field(default_factory=time.perf_counter)   # TTFT and latency count from here
    t_first: float = 0.0                          # perf_counter() when its first token was ready
    t_last: float = 0.0                           # ... and its last one
    history: sampling.TokenHistory | None = None  # tokens seen, when a bias or penalty needs them
    logprobs: list | None = None                  # one TokenLogprob per new id, when asked for
    logprobs_sent: int = 0                        # how many of them a streamed piece carried already
    # Where its keys and values stand (Chapters 7 to 9):
    num_computed: int = 0                         # tokens whose K/V are in the cache
    cached_tokens: int | None = None              # prompt tokens a prefix cache held (Chapter 8)
    admitted: float | None = None                 # first time a scheduler ran it (Chapter 9)
    preemptions: int = 0
    sink: object = None                           # where an engine loop sends its text (live traffic)
    # Speculative decoding (Chapter 10): guesses fed after the output, until verified
    draft_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0                          # guesses verified so far
    num_accepted: int = 0                         # ... and kept
    constraint: object = None                     # Chapter 11: a grammar its output must follow

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.new_ids)

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens start .. start+n-1 of prompt + output (+ guesses awaiting verification)."""
        p, after = len(self.prompt_ids), self.new_ids + self.draft_ids
        if start >= p:
            return after[start - p: start - p + n]
        return (self.prompt_ids + after)[start: start + n]
# --8<-- [end:request]


# --8<-- [start:sample]
def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token id per row: Chapter 1's sampling, each row with its own generator.

    Bias and penalties are applied to the whole batch first; log-probabilities are
    read from the logits as the model gave them.
    """
    adjusted = sampling.adjust_logits(logits, [r.params for r in requests], [r.history for r in requests])
    adjusted = constrain(adjusted, requests)
    if all(r.params.is_greedy for r in requests):
        tokens = sampling.greedy(adjusted).tolist()   # one argmax and one device sync for the batch
    else:
        tokens = [sampling.sample_next_token(row, r.params, r.generator) for row, r in zip(adjusted, requests)]
    asking = [i for i, r in enumerate(requests) if r.logprobs is not None and r.finish_reason is None]
    if asking:
        entries = sampling.token_logprobs(logits[asking], [tokens[i] for i in asking],
                                          [requests[i].params.logprobs for i in asking])
        for i, entry in zip(asking, entries):
            requests[i].logprobs.append(entry)
    return tokens
# --8<-- [end:sample]


# --8<-- [start:constrain]
def constrain(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Chapter 11: in each constrained row, -inf for the tokens its grammar forbids next.
    The other rows are left exactly as they were."""
    rows = [i for i, r in enumerate(requests) if r.constraint is not None and r.finish_reason is None]
    if not rows:
        return logits
    logits = logits.clone()   # never in place: the raw logits still give log-probabilities
    for i in rows:
        requests[i].constraint.mask(logits[i])
    return logits
# --8<-- [end:constrain]


# --8<-- [start:output-processor]
class OutputProcessor:
    """Token ids in, text and results out, the same for every engine from here on: it builds
    requests, accepts each new token (detokenizer, stop strings, EOS, budget, logprobs, timings)
    and turns a finished request into a GenerateResult."""

    def __init__(self, tokenizer, eos_token_ids: set[int], vocab_size: int, device):
        self.tokenizer, self.eos_token_ids, self.vocab_size, self.device = tokenizer, eos_token_ids, vocab_size, device
        self._ids = itertools.count()

    def new_request(self, prompt_ids: list[int], params: SamplingParams, budget: int,
                    arrival: float | None = None) -> Request:
        params.check_vocab(self.vocab_size)
        history = sampling.TokenHistory(prompt_ids, self.vocab_size, self.device) if params.adjusts_logits else None
        constraint = None if params.structured is None else plugins.plugin("structured_output")(
            self.tokenizer, self.vocab_size, self.eos_token_ids, params.structured)   # Chapter 11
        return Request(next(self._ids), list(prompt_ids), params, budget,
                       engine04.IncrementalDetokenizer(self.tokenizer, params.stop),
                       sampling.make_generator(params.seed, self.device), history=history,
                       logprobs=None if params.logprobs is None else [], constraint=constraint,
                       **({} if arrival is None else {"arrival": arrival}))
    # --8<-- [end:output-processor]

    # --8<-- [start:accept]
    def accept(self, r: Request, token_id: int, now: float) -> str:
        """Record one new token for one request; decide whether it is done; return its new text."""
        r.new_ids.append(token_id)
        r.t_first, r.t_last = r.t_first or now, now
        if r.history is not None:
            r.history.add(token_id)
        piece = r.detok.add(token_id)
        if r.constraint is not None and not r.constraint.accept(token_id):
            raise RuntimeError(f"token {token_id} breaks the request's grammar: was its row masked?")
        if r.detok.stopped or (token_id in self.eos_token_ids and r.params.stops_on_eos):
            r.finish_reason = "stop"        # the EOS / stop-completing token stays in new_ids
        elif len(r.new_ids) >= r.budget:
            r.finish_reason = "length"
        piece = piece + r.detok.flush() if r.finish_reason else piece
        piece, r.logprobs_sent = engine04.attach_logprobs(piece, r.logprobs, r.logprobs_sent, len(r.new_ids))
        return piece
    # --8<-- [end:accept]

    # --8<-- [start:metrics]
    def result(self, r: Request) -> GenerateResult:
        """The result every engine returns, with the loop's own timings, counted from arrival."""
        n = len(r.new_ids)
        metrics = contracts.RequestMetrics(
            throughput=n / max(r.t_last - r.arrival, 1e-9), input_tokens=r.n_prompt, output_tokens=n,
            ttft_ms=(r.t_first - r.arrival) * 1e3,                          # arrival -> first token ready
            tpot_ms=(r.t_last - r.t_first) / (n - 1) * 1e3 if n > 1 else None,   # mean gap after that
            queue_ms=None if r.admitted is None else (r.admitted - r.arrival) * 1e3,
            cached_tokens=r.cached_tokens,
            **({"draft_tokens": r.num_drafted, "accepted_tokens": r.num_accepted} if r.num_drafted else {}))
        return GenerateResult(text=r.detok.text, output_ids=list(r.new_ids), metrics=metrics,
                              finish_reason=r.finish_reason or "length",
                              logprobs=None if r.logprobs is None else list(r.logprobs[:n]))
    # --8<-- [end:metrics]


@functools.cache
def cache_keyword(model_class: type) -> str:
    """forward()'s keyword for the KV cache: transformers 5 renamed `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class DecodeLoopEngine(engine04.BaselineEngine):
    """Chapter 2: the same interface and results as BaselineEngine, with our own loop inside."""

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(model_name, device, dtype)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.vocab_size, self.device)
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
    parser = engine04.demo_parser("Chapter 2: our own prefill + decode loop.")
    parser.add_argument("--stream", action="store_true", help="then stream the answer token by token")
    parser.add_argument("--compare", type=cli.integer(0, 100), default=0, metavar="REPS",
                        help="time HF generate vs this loop (64 tokens, ignore_eos, REPS rounds)")
    args = parser.parse_args()
    engine, prompt, params = engine04.demo(DecodeLoopEngine, args)

    if args.stream:
        # --8<-- [start:stream-demo]
        print("\n[Streaming]\n  ", end="", flush=True)
        for item in engine.generate_stream(prompt, args.max_new_tokens, params):
            if isinstance(item, str):
                print(item, end="", flush=True)   # each piece as soon as its token exists
        print(f"\n  ({item.metrics.output_tokens} tokens, TTFT {item.metrics.ttft_ms:.0f} ms)")
        # --8<-- [end:stream-demo]

    if args.compare:
        prompts = engine04.reference_prompts()[:4]
        hf, ours = compare_with_generate(engine, prompts, 64, args.compare)
        print(f"\n[Speed, batch 1, 64 new tokens, {len(prompts)} prompts x {args.compare} rounds, alternating]")
        print(f"  HF generate  {hf:6.1f} tokens/s\n  our loop     {ours:6.1f} tokens/s\n  ratio        {ours / hf:6.3f}")


if __name__ == "__main__":
    main()
