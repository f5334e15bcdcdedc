"""Chapter 2: the request and the output processor. What every engine from here on shares.

A `Request` carries one prompt's token ids to its result; `sample` picks each row's next token
with Chapter 1's sampling; the `OutputProcessor` builds requests, accepts each new token
(detokenizer, stop strings, EOS, budget, log-probabilities, timings) and turns a finished
request into a `GenerateResult`. `07_decode_loop.py` drives them with a loop of its own.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from minivllm import sampling
from minivllm.contracts import NO_STRUCTURED_OUTPUT, GenerateResult, RequestMetrics, SamplingParams
from minivllm.sampling import TokenHistory
from minivllm.text import IncrementalDetokenizer, attach_logprobs, tokenize


def new_seed() -> int:
    """A seed for a request that brought none: from torch's global stream, so that
    torch.manual_seed makes a whole script's sampled answers repeat."""
    return int(torch.randint(2**62, ()))


# --8<-- [start:request]
@dataclass(eq=False)
class Request:
    """One request, from its prompt's token ids to its result: the one object that every engine,
    the scheduler (Chapter 9) and the block manager (Chapter 7, by id) pass around."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    budget: int                                   # new tokens it may produce
    detok: IncrementalDetokenizer        # text so far, and whether a stop string appeared
    seed: int = 0                                 # what its sampled tokens' noise comes from
    new_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None              # None while still running
    arrival: float = field(default_factory=time.perf_counter)   # TTFT and latency count from here
    t_first: float = 0.0                          # perf_counter() when its first token was ready
    t_last: float = 0.0                           # ... and its last one
    history: TokenHistory | None = None  # tokens seen, when a bias or penalty needs them
    logprobs: list | None = None                  # one TokenLogprob per new id, when asked for
    logprobs_sent: int = 0                        # how many of them a streamed piece carried already
    prompt_logprobs: list | None = None           # [None, one TokenLogprob per prompt token scored so far]
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
    adapter: object = None                        # Chapter 17: its LoRA adapter (None: the base weights)
    held_back: tuple[int, ...] = ()               # ids that may not come before min_tokens (EOS, stop ids)
    prompt: str | None = None                     # the prompt's text, when it came as text
    # Chapter 16: one of several answers to a prompt. The first member (choice 0) is prefilled;
    # the others wait in its `siblings` until it forks them onto its blocks.
    choice: int = 0                               # which answer: its noise key's second number
    group: list | None = None                     # every answer to the prompt, choice 0 first
    siblings: list = field(default_factory=list)  # members not forked yet (choice 0's, until it forks)

    @property
    def cache_salt(self):
        """What its cached prefix blocks are keyed by besides the tokens: the client's salt and, with
        an adapter (Chapter 17), that adapter's load: the same text under another adapter shares nothing."""
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.n_prompt:
            # scoring a prompt needs the logits of every position: a cached prefix has its K/V but
            # not those, so this request shares no cached block until its prompt is scored
            return ("prompt_logprobs", self.id, self.params.cache_salt)
        if self.adapter is None:
            return self.params.cache_salt
        return ("lora", self.adapter.key, self.params.cache_salt)

    @property
    def seats(self) -> int:
        """Sequences it holds in the batch: itself and the siblings it will fork (Chapter 16)."""
        return 1 + len(self.siblings)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.new_ids)

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens start .. start+n-1 of prompt + output (+ guesses awaiting verification), copying
        only those: a decode step asks for one token of a sequence thousands long."""
        out, end = [], start + n
        for part in (self.prompt_ids, self.new_ids, self.draft_ids):
            if start < len(part) and end > 0:
                out += part[max(start, 0):end]
            start, end = start - len(part), end - len(part)
        return out

    def first_tokens(self, n: int) -> TokenPrefix:
        """Its first n tokens as a sequence that copies only the slices asked of it."""
        return TokenPrefix(self, n)


class TokenPrefix:
    """A request's first n tokens, read on demand: what a prefix cache reads each step (the
    tokens of a block just filled), with no copy of the whole sequence."""

    def __init__(self, request: Request, n: int):
        self.request, self.n = request, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, part: slice) -> list[int]:
        start, stop, _ = part.indices(self.n)
        return self.request.tokens(start, max(stop - start, 0))
# --8<-- [end:request]


# --8<-- [start:sample]
def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token id per row (`sample_on_device`), moved to the host in one transfer, with the
    log-probabilities that requests asked for."""
    tokens = sample_on_device(logits, requests).tolist()   # the step's one transfer
    asking = [i for i, r in enumerate(requests) if r.logprobs is not None and r.finish_reason is None]
    if asking:
        entries = sampling.token_logprobs(logits[asking], [tokens[i] for i in asking],
                                          [requests[i].params.logprobs or 0 for i in asking])
        for i, entry in zip(asking, entries):
            requests[i].logprobs.append(entry)
    return tokens


def sample_on_device(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The step's tokens, left on the device: the argmax for greedy rows, the Gumbel-max race
    for sampled ones, with no wait for the device (`19_gpu.py --check` runs it under CUDA's
    sync debug mode).

    Bias and penalties are applied to the whole batch first; log-probabilities are
    read from the logits as the model gave them. A sampled row's noise is keyed on its seed
    and output position (`draw_key`), so its token does not depend on its batch mates, on the
    device, or on whether speculation (Chapter 10) guessed it: one rule for every drawn token.
    """
    adjusted = sampling.adjust_logits(logits, [r.params for r in requests], [r.history for r in requests])
    adjusted = hold_back(constrain(adjusted, requests), requests)   # min_tokens: EOS and stop ids wait
    chosen = sampling.greedy(adjusted)
    drawn = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if drawn:   # one race for every sampled row of the step; nothing waits for the device until .tolist()
        log_p = torch.stack([sampling.probabilities(adjusted[i], requests[i].params) for i in drawn]).log()
        index = torch.tensor(drawn).to(chosen.device, non_blocking=True)
        chosen = chosen.index_copy(0, index, sampling.race(log_p, [draw_key(requests[i]) for i in drawn]))
    return chosen
# --8<-- [end:sample]


def draw_key(r: Request, ahead: int = 0) -> int:
    """The noise key of r's next sampled token (or of the one `ahead` positions after it)."""
    return sampling.noise_key(r.seed, r.choice, len(r.new_ids) + ahead)


# --8<-- [start:constrain]
def constrain(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Chapter 11: in each constrained row, -inf for the tokens its grammar forbids next.
    The other rows are left exactly as they were. Each grammar writes its row of a bitmask on
    the CPU (1 bit a token); the bitmask goes to the logits' device in one copy for the whole
    step, and is unpacked and applied there."""
    rows = [i for i, r in enumerate(requests) if r.constraint is not None and r.finish_reason is None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    words = torch.empty(len(rows), -(-vocab // 32), dtype=torch.int32)
    for j, i in enumerate(rows):
        requests[i].constraint.fill_bitmask(words, j)
    keep = unpack_bits(words.to(logits.device), vocab)
    index = torch.tensor(rows, device=logits.device)
    logits = logits.clone()   # never in place: the raw logits still give log-probabilities
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    return logits


# --8<-- [start:hold-back]
def hold_back(logits: torch.Tensor, requests: list[Request], ahead: int = 0) -> torch.Tensor:
    """vLLM's min_tokens: -inf for EOS and the stop token ids of each row whose request has fewer
    than min_tokens new tokens (ahead: guesses before this row, Chapter 10's verification)."""
    rows = [i for i, r in enumerate(requests) if r.held_back and len(r.new_ids) + ahead < r.params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()   # never in place: the raw logits still give log-probabilities
    for i in rows:
        logits[i, list(requests[i].held_back)] = float("-inf")
    return logits
# --8<-- [end:hold-back]


def unpack_bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bools, on the words' device: bit j of word w is token 32w + j."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> bits) & 1).bool().view(words.shape[0], -1)[:, :vocab]


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """[vocab] bools -> the int32 words unpack_bits reads (for a constraint that decides token by token)."""
    bits = torch.zeros(-(-len(keep) // 32) * 32, dtype=torch.int64)
    bits[:len(keep)] = keep.to(torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
# --8<-- [end:constrain]


def logprob_tokens(r: Request) -> int:
    """How many tokens' log-probabilities go out: those of the text returned, so a stop string's
    own tokens (kept in new_ids) are not listed after the text that ends before them."""
    return r.detok.tokens_in_text if r.detok.stopped else len(r.new_ids)


def stop_reason(r: Request) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the request (None: EOS, the budget)."""
    if r.finish_reason != "stop":
        return None
    if r.detok.stopped:
        return r.detok.stop_found
    last = r.new_ids[-1] if r.new_ids else None
    return last if last in r.params.stop_token_ids else None


# --8<-- [start:output-processor]
class OutputProcessor:
    """Token ids in, text and results out, the same for every engine from here on: it builds
    requests, accepts each new token (detokenizer, stop strings, EOS, budget, logprobs, timings)
    and turns a finished request into a GenerateResult."""

    forks = False   # Chapter 16's processor makes n answers to one prompt (minivllm/many_answers.py)

    def __init__(self, tokenizer, eos_token_ids: set[int], vocab_size: int, device, structured_output=None):
        self.tokenizer, self.eos_token_ids, self.vocab_size, self.device = tokenizer, eos_token_ids, vocab_size, device
        self.structured_output = structured_output   # Chapter 11's feature object, when the engine has it
        self._ids = itertools.count()

    # --8<-- [start:request-for]
    def request_for(self, prompt: str | list[int], max_new_tokens: int, params: SamplingParams | None,
                    context_length: int, arrival: float | None = None) -> Request:
        """A prompt (text, or token ids tokenised already) checked against its budget and the context,
        tokenised, and made a request: what an engine's new_request does, in the caller's thread."""
        params = SamplingParams.or_default(params)
        if params.num_sequences > 1 and not self.forks:
            raise ValueError(f"this engine gives one answer per prompt, not n = {params.num_sequences}: "
                             f"LLM's output processor forks them (Chapter 16)")
        budget = params.token_budget(max_new_tokens)
        ids = tokenize(self.tokenizer, prompt, budget, context_length, self.vocab_size)
        r = self.new_request(ids, params, budget, arrival)
        r.prompt = prompt if isinstance(prompt, str) else None
        return r
    # --8<-- [end:request-for]

    def new_request(self, prompt_ids: list[int], params: SamplingParams, budget: int,
                    arrival: float | None = None) -> Request:
        params.check_vocab(self.vocab_size)
        history = TokenHistory(prompt_ids, self.vocab_size, self.device) if params.adjusts_logits else None
        constraint = None
        if params.structured is not None:   # Chapter 11: the grammar its output must follow
            if self.structured_output is None:
                raise ValueError(NO_STRUCTURED_OUTPUT)
            constraint = self.structured_output.constraint(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                           params.structured)
        held = (tuple(self.eos_token_ids) if params.stops_on_eos else ()) + params.stop_token_ids \
            if params.min_tokens else ()
        return Request(next(self._ids), list(prompt_ids), params, budget,
                       IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens),
                       new_seed() if params.seed is None else params.seed, history=history,
                       logprobs=None if params.logprobs is None else [], constraint=constraint, held_back=held,
                       prompt_logprobs=None if params.prompt_logprobs is None else [None],
                       **({} if arrival is None else {"arrival": arrival}))
    # --8<-- [end:output-processor]

    # --8<-- [start:accept]
    def accept(self, r: Request, token_id: int, now: float) -> str:
        """Record one new token for one request; decide whether it is done; return its new text."""
        r.new_ids.append(token_id)
        r.t_first, r.t_last = r.t_first or now, now
        if r.history is not None:
            r.history.add(token_id)
        stop_id = token_id in r.params.stop_token_ids and len(r.new_ids) > r.params.min_tokens
        piece = "" if stop_id else r.detok.add(token_id)   # a stop token id's text is not the answer's
        if r.constraint is not None and not r.constraint.accept(token_id):
            raise RuntimeError(f"token {token_id} breaks the request's grammar: was its row masked?")
        if stop_id or r.detok.stopped or (token_id in self.eos_token_ids and r.params.stops_on_eos):
            r.finish_reason = "stop"        # the EOS / stop-completing token stays in new_ids
        elif len(r.new_ids) >= r.budget:
            r.finish_reason = "length"
        piece = piece + r.detok.flush() if r.finish_reason else piece
        piece, r.logprobs_sent = attach_logprobs(piece, r.logprobs, r.logprobs_sent, logprob_tokens(r))
        return piece
    # --8<-- [end:accept]

    # --8<-- [start:metrics]
    def result(self, r: Request) -> GenerateResult:
        """The result every engine returns, with the loop's own timings, counted from arrival."""
        n = len(r.new_ids)
        metrics = RequestMetrics(
            throughput=n / max(r.t_last - r.arrival, 1e-9), input_tokens=r.n_prompt, output_tokens=n,
            ttft_ms=(r.t_first - r.arrival) * 1e3,                          # arrival -> first token ready
            tpot_ms=(r.t_last - r.t_first) / (n - 1) * 1e3 if n > 1 else None,   # mean gap after that
            queue_ms=None if r.admitted is None else (r.admitted - r.arrival) * 1e3,
            cached_tokens=r.cached_tokens,
            **({"draft_tokens": r.num_drafted, "accepted_tokens": r.num_accepted} if r.num_drafted else {}))
        return GenerateResult(text=r.detok.text, output_ids=list(r.new_ids), metrics=metrics,
                              finish_reason=r.finish_reason or "length", prompt=r.prompt,
                              prompt_token_ids=list(r.prompt_ids), stop_reason=stop_reason(r),
                              logprobs=None if r.logprobs is None else list(r.logprobs[:logprob_tokens(r)]),
                              # whole, or None where the engine's runner does not score prompts
                              # (EngineCapabilities.scores_prompts)
                              prompt_logprobs=list(r.prompt_logprobs) if r.prompt_logprobs is not None
                              and len(r.prompt_logprobs) == r.n_prompt else None)
    # --8<-- [end:metrics]
