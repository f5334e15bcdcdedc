"""Chapter 10: speculative decoding. Guess several tokens, verify them in one forward.

A decode step reads every weight to produce one token. If something cheap guesses the next k
tokens, one forward of the model over those k guesses checks them all: each guess the model
would have produced itself is kept, the first it would not is replaced by its own token. Greedy
output is unchanged; sampled output keeps its distribution (rejection sampling against the
guesser's own distribution). Two guessers: n-gram lookup in the request's own text, and a draft
model on its own KV pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from minivllm import sampling
from minivllm.block_manager import BlockManager
from minivllm.contracts import is_integer
from minivllm.kv_cache import KVPool, PoolFullError
from minivllm.model import LlamaModel
from minivllm.model_files import resolve_model
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import Request, constrain, sample

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
# Tokens one verification step may feed the model across all requests, guesses included. With a
# few dozen rows a CPU's matmuls already wait on arithmetic, not memory (Chapter 4), so a guess
# costs about what a token does: a busy step guesses less (16 decoding requests one guess each,
# 17 or more none; --concurrent in 14_speculative_decoding_demo.py measures it).
SPECULATION_TOKEN_BUDGET = 32
# An answer that copies its input: prompt lookup's best case (main()'s default prompt).
COPYING_PROMPT = ("Repeat the first two sentences of this text word for word: A KV cache stores the keys and "
                  "values that attention computed for earlier tokens. Without it, every new token would recompute "
                  "them for the whole prompt. The cache grows by one entry per layer for every token.")


# --8<-- [start:ngram]
class NgramProposer:
    """Prompt lookup: find the last n tokens earlier in prompt + output, propose what followed."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: list[Request], ks: list[int]) -> list[torch.Tensor | None]:
        """Sets each request's draft_ids (up to k); a guess is certain, so there is no q to return."""
        for r, k in zip(requests, ks):
            r.draft_ids = self.lookup(r.prompt_ids + r.new_ids, k) if k else []
        return [None] * len(requests)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest matching suffix: the
        latest occurrence (the nearest context) that is followed by k tokens, else the longest run."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix, best = tokens[-n:], []
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    run = tokens[start + n:start + n + k]
                    if len(run) == k:
                        return run
                    best = max(best, run, key=len)
            if best:
                return best
        return []

    def release(self, request: Request) -> None:
        """Nothing held per request."""
# --8<-- [end:ngram]


# --8<-- [start:draft-model]
class DraftModelProposer:
    """A smaller model guesses k tokens, one decode step each, on its own KV pool of blocks.

    It remembers how many of each request's tokens it holds K/V for; after a verification it
    keeps only those the target kept, and catches up on the rest before it guesses, at most
    `chunk` tokens a step in all (the engine's step budget): a long new prompt is caught up over
    several steps, in chunks, as the target prefills it, and guesses wait until it is done.
    """

    def __init__(self, model, kv_memory: int, block_size: int, chunk: int = 256):
        pool = KVPool.from_memory(model.config, kv_memory, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, pool)
        self.blocks = BlockManager(pool.num_blocks, block_size)
        self.computed: dict[int, int] = {}     # request id -> tokens whose K/V the draft holds
        self.chunk = chunk

    def propose(self, requests: list[Request], ks: list[int]) -> list[torch.Tensor | None]:
        """Sets each request's draft_ids; returns per request the distributions q it drew them
        from ([k, vocab], for sampled requests; None for greedy ones)."""
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        live = [i for i, k in enumerate(ks) if k and self._room(requests[i], k)]
        for i in range(len(requests)):
            requests[i].draft_ids = []
        live = self._catch_up(requests, live)
        for step in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if ks[i] > step]
            if not live:
                break
            rs = [requests[i] for i in live]
            starts = [self.computed[r.id] for r in rs]
            lengths = [r.num_tokens + len(r.draft_ids) - s for r, s in zip(rs, starts)]   # the newest, then a guess
            logits = self.runner.forward(rs, starts, lengths, [self.blocks.tables[r.id] for r in rs])
            logits = sampling.adjust_logits(logits, [r.params for r in rs], [r.history for r in rs])
            logits = constrain(logits, rs)           # a grammar's requests guess within it
            for i, r, row in zip(live, rs, logits):
                self.computed[r.id] = r.num_tokens + len(r.draft_ids)
                if r.params.is_greedy:
                    r.draft_ids.append(int(row.argmax()))
                else:
                    q = sampling.probabilities(row, r.params)
                    r.draft_ids.append(int(torch.multinomial(q, 1, generator=r.generator)))
                    qs[i].append(q)
                if r.constraint is not None:
                    r.constraint.accept(r.draft_ids[-1])
                    if r.constraint.finished:
                        ks[i] = len(r.draft_ids)                # nothing may follow the grammar's end
        for r in requests:
            if r.constraint is not None and r.draft_ids:
                r.constraint.rollback(len(r.draft_ids))
        return [torch.stack(q) if q else None for q in qs]

    def _catch_up(self, requests: list[Request], live: list[int]) -> list[int]:
        """K/V for every known token but the newest, in one forward of at most `chunk` tokens;
        returns the requests that are caught up (they guess this step), in order."""
        budget, feed = self.chunk, []
        for i in live:
            r = requests[i]
            n = min(r.num_tokens - 1 - self.computed[r.id], budget)
            if n > 0:
                feed.append((r, self.computed[r.id], n))
                budget -= n
        if feed:
            rs, starts, lengths = map(list, zip(*feed))
            self.runner.forward(rs, starts, lengths, [self.blocks.tables[r.id] for r in rs])   # logits unused
            for r, start, n in feed:
                self.computed[r.id] = start + n
        return [i for i in live if self.computed[requests[i].id] == requests[i].num_tokens - 1]

    def _room(self, r: Request, k: int) -> bool:
        """Slots for everything the draft will feed; a full pool means no guesses this time."""
        if r.id not in self.computed:
            if not self.blocks.can_allocate(r.num_tokens + k):
                return False
            self.blocks.allocate(r.id, r.num_tokens)
            self.computed[r.id] = 0
        self.computed[r.id] = min(self.computed[r.id], r.num_tokens - 1)   # K/V past the kept tokens is stale
        try:
            while self.blocks.lengths[r.id] < r.num_tokens + k - 1:
                self.blocks.append_slot(r.id)
        except PoolFullError:
            self.release(r)
            return False
        return True

    def release(self, request: Request) -> None:
        """The request left the engine: its draft blocks go back."""
        if self.computed.pop(request.id, None) is not None:
            self.blocks.free(request.id)
# --8<-- [end:draft-model]


# --8<-- [start:accept]
def accept_guesses(logits: torch.Tensor, r: Request, q: torch.Tensor | None) -> list[int]:
    """The tokens one verification yields: the guesses the model keeps, then one of its own.

    logits[j] is the model's prediction after the guesses d1 .. dj; q[j] (sampled requests of a
    draft model) is the distribution dj+1 was drawn from; a lookup's guess is certain (q = 1).
    """
    drafts, params = r.draft_ids, r.params
    history = r.history.copy() if r.history is not None else None   # penalties see the kept guesses
    grammar, walked = r.constraint, 0        # Chapter 11: so does a grammar, walked ahead, then back
    out: list[int] = []
    for j, row in enumerate(logits):
        if history is not None:
            row = sampling.adjust_logits(row.unsqueeze(0), [params], [history])[0]
        if grammar is not None:
            row = constrain(row.unsqueeze(0), [r])[0]   # a guess it forbids has p = 0
        guess = drafts[j] if j < len(drafts) else None
        if params.is_greedy:                        # keep the guess only if it is the argmax itself
            token = int(row.argmax())
        else:
            p = sampling.probabilities(row, params)
            if guess is None:                       # every guess kept: the last position is a free token
                token = int(torch.multinomial(p, 1, generator=r.generator))
            else:
                q_guess = 1.0 if q is None else float(q[j, guess])
                if float(torch.rand((), generator=r.generator, device=p.device)) * q_guess < float(p[guess]):
                    token = guess                   # kept with probability min(1, p / q)
                else:                               # rejected: draw from what p has beyond q
                    residual = (p - (q[j] if q is not None else torch.nn.functional.one_hot(
                        torch.tensor(guess, device=p.device), p.numel()).to(p.dtype))).clamp(min=0)
                    if float(residual.sum()) <= 0:   # p <= q everywhere (rounding): nothing beyond q, draw from p
                        residual = p
                    token = int(torch.multinomial(residual, 1, generator=r.generator))
        out.append(token)
        if token != guess:
            break
        if history is not None:
            history.add(token)
        if grammar is not None:
            grammar.accept(token)
            walked += 1
            if grammar.finished:                    # the grammar's end: nothing may follow
                break
    if walked:
        grammar.rollback(walked)                    # the output processor advances it, token by token
    return out
# --8<-- [end:accept]


# --8<-- [start:verify]
class Speculator:
    """Speculation composed onto a model runner: propose before the step, verify in it."""

    def __init__(self, name: str, proposer, num_speculative_tokens: int):
        self.name, self.proposer, self.k = name, proposer, num_speculative_tokens
        self.q: dict[int, torch.Tensor | None] = {}

    def propose(self, running: list[Request]) -> list:
        """Guesses for every request about to decode, k bounded by its budget and the step's."""
        decoding = [r for r in running if r.num_tokens - r.num_computed == 1]
        per_request = SPECULATION_TOKEN_BUDGET // max(1, len(decoding)) - 1   # a busy step guesses less
        ks = [max(0, min(self.k, per_request, r.budget - len(r.new_ids) - 1)) for r in decoding]
        self.q = dict(zip(map(id, decoding), self.proposer.propose(decoding, ks)))
        return decoding

    def step(self, runner, requests: list[Request], starts: list[int], lengths: list[int],
             places: list) -> list[list[int] | None]:
        """prepare -> forward -> accept: the tokens each request keeps (None: a prefill chunk)."""
        ready = [s + n == r.num_tokens + len(r.draft_ids) for r, s, n in zip(requests, starts, lengths)]
        num_logits = [1 + len(r.draft_ids) if ok else 1 for r, ok in zip(requests, ready)]
        logits = runner.forward(requests, starts, lengths, places, num_logits).split(num_logits)
        runs: list[list[int] | None] = [None] * len(requests)
        plain = [i for i, r in enumerate(requests) if ready[i] and not r.draft_ids]
        for i, token in zip(plain, sample(torch.cat([logits[i] for i in plain]), [requests[i] for i in plain])
                            if plain else []):
            runs[i] = [token]
        for i, r in enumerate(requests):
            if ready[i] and r.draft_ids:
                runs[i] = accept_guesses(logits[i], r, self.q.get(id(r)))
                if r.logprobs is not None:   # one entry per kept token, from the model's own logits
                    r.logprobs.extend(sampling.token_logprobs(logits[i][:len(runs[i])], runs[i],
                                                              [r.params.logprobs] * len(runs[i])))
                r.num_drafted += len(r.draft_ids)   # accepted ones are counted as the output takes them
                r.draft_ids = []
        return runs

    def release(self, request: Request) -> None:
        self.proposer.release(request)
# --8<-- [end:verify]


# --8<-- [start:options]
class SpeculativeDecoding:
    """The engine's `speculative=` option as a feature it is handed, checked before any model
    loads. `build` makes the Speculator once the target is loaded: the n-gram lookup needs
    nothing; a draft model is loaded with the features it is given (by default the composition
    root hands this very model's folder and an int4 format, Chapter 12: a cheap self-draft) and
    gets a KV pool of the size the engine was asked for."""

    def __init__(self, method: str, num_speculative_tokens: int = 4, draft_model: str | None = None):
        if method not in METHODS:
            raise ValueError(f"speculative must be one of {', '.join(METHODS)} (or None), got {method!r}")
        if not is_integer(num_speculative_tokens) or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {num_speculative_tokens!r}")
        if draft_model is not None and method != "draft":
            raise ValueError("draft_model needs speculative='draft'")
        self.method, self.k, self.draft_model = method, num_speculative_tokens, draft_model

    def build(self, target: LlamaModel, folder: Path, kv_memory: int, block_size: int,
              draft_features: Sequence = (), max_num_batched_tokens: int = 256) -> Speculator:
        if self.method == "ngram":
            return Speculator(self.method, NgramProposer(), self.k)
        folder = Path(resolve_model(self.draft_model)) if self.draft_model else Path(folder)
        model = load_model(folder, target.dtype, target.device, draft_features)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                             f"target's ({target.config.vocab_size}): it needs the same tokenizer")
        print(f"[engine] draft model: {folder.name} ({model.format_name or 'float'}), "
              f"{model.weight_bytes / 1e6:.0f} MB", flush=True)
        return Speculator(self.method, DraftModelProposer(model, kv_memory, block_size, max_num_batched_tokens), self.k)
# --8<-- [end:options]
