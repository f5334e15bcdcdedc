"""Chapter 10: speculative decoding. Guess several tokens, verify them in one forward.

A decode step reads every weight to produce one token. If something cheap guesses the next k
tokens, one forward of the model over those k guesses checks them all: each guess the model
would have produced itself is kept, the first it would not is replaced by its own token. Greedy
output is unchanged; a sampled token is drawn from noise that depends only on the request's
seed and the token's position, so it too is the model's own, whatever was guessed and whoever
shared the step. Two guessers: n-gram lookup in the request's own text, and a draft model on
its own KV pool. Guesses get only what the step's token budget leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from minivllm import prompt_logprobs, sampling
from minivllm.block_manager import BlockManager
from minivllm.config import SPECULATIVE_METHODS, check_option
from minivllm.kv_cache import KVPool, PoolFullError
from minivllm.model import LlamaModel
from minivllm.model_files import resolve_model
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import Request, constrain, hold_back, sample

# Tokens one verification step may feed the model across all requests, guesses included. With a
# few dozen rows a CPU's matmuls already wait on arithmetic, not memory (Chapter 4), so a guess
# costs about what a token does: a busy step guesses less (16 decoding requests one guess each,
# 17 or more none; --concurrent in 14_speculative_decoding_demo.py measures it).
SPECULATION_TOKEN_BUDGET = 32
# A request whose guesses keep failing (a sampled answer that never repeats itself) pays every step
# for verified rows that are thrown away: on a CPU's plain matmuls, two to nine rows cost 1.7 to 2.6
# times one row. After m verifications in a row that kept nothing, it sits out 2**(m-1) - 1 decode
# steps, at most MAX_REST: one miss costs nothing (a copying answer that paused), and a request whose
# guesses never match has them verified once every MAX_REST + 1 steps. Output is unchanged: a guess
# never decides a token, only how many tokens one forward yields.
MAX_REST = 15
# An answer that copies its input: prompt lookup's best case (main()'s default prompt).
COPYING_PROMPT = ("Repeat the first two sentences of this text word for word: A KV cache stores the keys and "
                  "values that attention computed for earlier tokens. Without it, every new token would recompute "
                  "them for the whole prompt. The cache grows by one entry per layer for every token.")


# --8<-- [start:draw]
def draw(p: torch.Tensor, seed: int, position: int, choice: int = 0) -> int:
    """The token a sampled request takes at output position `position`, from distribution p.

    The engine's one rule for a drawn token (`sampling.race`, as `output.sample` draws it):
    the Gumbel-max race with noise made from the request's seed and the position alone, never
    from a stream that every draw advances, so the token at a position does not depend on how
    many guesses came before it, or on who else shared the step: a sampled answer with
    speculation is the answer without it. A drafter that draws its guess with the same noise
    from its own q agrees with the model wherever q is close to p.
    """
    return int(sampling.race(p.log().unsqueeze(0), [sampling.noise_key(seed, choice, position)])[0])
# --8<-- [end:draw]


# --8<-- [start:ngram]
class NgramProposer:
    """Prompt lookup: find the last n tokens earlier in prompt + output, propose what followed."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: list[Request], ks: list[int], max_tokens: int) -> None:
        """Sets each request's draft_ids (up to k): what followed, up to the first token that the
        request's grammar (Chapter 11) forbids. A lookup needs no model, so no budget."""
        for r, k in zip(requests, ks):
            r.draft_ids = within_grammar(r, self.lookup(r.prompt_ids + r.new_ids, k)) if k else []

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


def within_grammar(r: Request, guesses: list[int]) -> list[int]:
    """Chapter 11: the guesses up to the first one the request's grammar forbids (nothing follows
    the grammar's end). The grammar is walked ahead, then rolled back: the output processor
    advances it once the model has kept the tokens."""
    grammar, kept = r.constraint, 0
    if grammar is None:
        return guesses
    for token in guesses:
        if grammar.finished or not grammar.allowed(token):
            break
        grammar.accept(token)
        kept += 1
    if kept:
        grammar.rollback(kept)
    return guesses[:kept]
# --8<-- [end:ngram]


# --8<-- [start:draft-model]
class DraftModelProposer:
    """A smaller model guesses k tokens, one decode step each, on its own KV pool of blocks.

    It remembers how many of each request's tokens it holds K/V for; after a verification it
    keeps only those the target kept, and catches up on the rest in its next first step, in
    chunks under the engine's token budget, as the target prefills a long prompt.
    """

    def __init__(self, model, kv_memory: int, block_size: int):
        pool = KVPool.from_memory(model.config, kv_memory, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, pool)
        self.blocks = BlockManager(pool.num_blocks, block_size)
        self.computed: dict[int, int] = {}     # request id -> tokens whose K/V the draft holds

    def propose(self, requests: list[Request], ks: list[int], max_tokens: int) -> None:
        """Sets each request's draft_ids. Its first forward catches each request up (the tokens it
        lacks, the newest one included), at most max_tokens in all: a request still behind after
        its chunk guesses nothing this step. Then one token per request per forward."""
        for r in requests:
            r.draft_ids = []
        live, starts, lengths = [], [], []
        for i, k in enumerate(ks):
            if k and max_tokens > 0 and self._room(requests[i], k):
                r = requests[i]
                n = min(r.num_tokens - self.computed[r.id], max_tokens)
                live.append(i), starts.append(self.computed[r.id]), lengths.append(n)
                max_tokens -= n
        ks = list(ks)
        for step in range(max((ks[i] for i in live), default=0)):
            if not live:
                break
            rs = [requests[i] for i in live]
            logits = self.runner.forward(rs, starts, lengths, [self.blocks.tables[r.id] for r in rs])
            logits = sampling.adjust_logits(logits, [r.params for r in rs], [r.history for r in rs])
            logits = constrain(logits, rs)           # a grammar's requests guess within it
            for i, r, s, n, row in zip(live, rs, starts, lengths, logits):
                self.computed[r.id] = s + n
                if s + n < r.num_tokens:            # still catching up: no guesses this step
                    ks[i] = 0
                    continue
                position = len(r.new_ids) + len(r.draft_ids)
                r.draft_ids.append(int(row.argmax()) if r.params.is_greedy else
                                   draw(sampling.probabilities(row, r.params), r.seed, position, r.choice))
                if r.constraint is not None:
                    r.constraint.accept(r.draft_ids[-1])
                    if r.constraint.finished:
                        ks[i] = len(r.draft_ids)                # nothing may follow the grammar's end
            live = [i for i in live if len(requests[i].draft_ids) < ks[i]]
            starts = [requests[i].num_tokens + len(requests[i].draft_ids) - 1 for i in live]
            lengths = [1] * len(live)                           # the newest guess, to guess the next
        for r in requests:
            if r.constraint is not None and r.draft_ids:
                r.constraint.rollback(len(r.draft_ids))

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
def accept_guesses(logits: torch.Tensor, r: Request) -> tuple[list[int], int]:
    """The tokens one verification yields, and how many of them are kept guesses.

    logits[j] is the model's prediction after the guesses d1 .. dj. At each position the model
    takes its own token: the argmax (greedy) or draw(p, seed, position) (sampled). A guess is
    kept if it is that very token; at the first that is not, the model's token replaces it and
    the rest are thrown away. The tokens are those the model would have produced without guesses.
    """
    drafts, params = r.draft_ids, r.params
    history = r.history.copy() if r.history is not None else None   # penalties see the kept guesses
    grammar, walked = r.constraint, 0        # Chapter 11: so does a grammar, walked ahead, then back
    out: list[int] = []
    for j, row in enumerate(logits):
        if history is not None:
            row = sampling.adjust_logits(row.unsqueeze(0), [params], [history])[0]
        if grammar is not None:
            row = constrain(row.unsqueeze(0), [r])[0]   # a guess it forbids is never the model's token
        row = hold_back(row.unsqueeze(0), [r], ahead=j)[0]   # min_tokens: no EOS this early
        if params.is_greedy:
            token = int(row.argmax())
        else:
            token = draw(sampling.probabilities(row, params), r.seed, len(r.new_ids) + j, r.choice)
        out.append(token)
        if j >= len(drafts) or token != drafts[j]:
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
    kept = len(out) if len(out) <= len(drafts) and out == drafts[:len(out)] else len(out) - 1
    return out, kept
# --8<-- [end:accept]


# --8<-- [start:verify]
class Speculator(ModelRunner):
    """Speculation composed onto a model runner, as a runner: it proposes before the step and
    verifies in it, behind the calls the engine makes of every runner (propose, run, settle,
    release), so the engine's step has no branch for it. The runner it wraps computes."""

    def __init__(self, runner: ModelRunner, name: str, proposer, num_speculative_tokens: int):
        self.runner, self.name, self.proposer, self.k = runner, name, proposer, num_speculative_tokens
        self.kept: dict[int, tuple[int, int, int]] = {}    # id(request) -> (outputs before, guesses made, kept)
        self.misses: dict[int, int] = {}                   # request id -> verifications in a row that kept nothing
        self.resting: dict[int, int] = {}                  # request id -> decode steps left without guesses

    def propose(self, work, max_num_batched_tokens: int) -> None:
        """Guesses for the requests of a scheduled step that decode, from what the step's token
        budget has left once everyone's decode token and prefill chunk is in: shared one guess
        at a time in turn, so nobody gets a second before every other has had a first."""
        decoding = [r for r, n in zip(work.requests, work.lengths) if n == 1 and r.num_tokens - r.num_computed == 1]
        per_request = SPECULATION_TOKEN_BUDGET // max(1, len(decoding)) - 1   # a busy step guesses less
        wants = [0 if self.rest(r) else max(0, min(self.k, per_request, r.budget - len(r.new_ids) - 1))
                 for r in decoding]
        spare, ks = max_num_batched_tokens - work.num_tokens, [0] * len(decoding)
        for _ in range(max(wants, default=0)):
            for i, want in enumerate(wants):
                if spare and ks[i] < want:
                    ks[i], spare = ks[i] + 1, spare - 1
        self.proposer.propose(decoding, ks, max_num_batched_tokens)

    def rest(self, r: Request) -> bool:
        """Whether r sits out this step's guessing (one step of its rest taken)."""
        if self.resting.get(r.id, 0) == 0:
            return False
        self.resting[r.id] -= 1
        return True

    def run(self, requests: list[Request], starts: list[int], lengths: list[int],
            places: list) -> list[list[int] | None]:
        """prepare -> forward -> accept: the tokens each request keeps (None: a prefill chunk)."""
        ready = [s + n == r.num_tokens + len(r.draft_ids) for r, s, n in zip(requests, starts, lengths)]
        num_logits = [1 + len(r.draft_ids) if ok else 1 for r, ok in zip(requests, ready)]
        scoring = prompt_logprobs.logit_rows(requests, starts, lengths)   # a prefill scoring its prompt
        if scoring is not None:      # has no guesses: its whole chunk's rows, then its last as one
            num_logits = [m if r.draft_ids else n for r, m, n in zip(requests, num_logits, scoring)]
        logits = self.runner.forward(requests, starts, lengths, places, num_logits).split(num_logits)
        if scoring is not None:
            logits = [block if r.draft_ids else prompt_logprobs.record(block, [r], [s], [n], [len(block)])
                      for r, s, n, block in zip(requests, starts, lengths, logits)]
        runs: list[list[int] | None] = [None] * len(requests)
        plain = [i for i, r in enumerate(requests) if ready[i] and not r.draft_ids]   # the same draw either way
        for i, token in zip(plain, sample(torch.cat([logits[i] for i in plain]), [requests[i] for i in plain])
                            if plain else []):
            runs[i] = [token]
        for i, r in enumerate(requests):   # guesses to check, or a sampled token: drawn by position
            if ready[i] and i not in plain:
                runs[i], kept = accept_guesses(logits[i], r)
                if r.logprobs is not None:   # one entry per kept token, from the model's own logits
                    r.logprobs.extend(sampling.token_logprobs(logits[i][:len(runs[i])], runs[i],
                                                              [r.params.logprobs] * len(runs[i])))
                r.num_drafted += len(r.draft_ids)
                self.kept[id(r)] = (len(r.new_ids), len(r.draft_ids), kept)
                r.draft_ids = []
        return runs

    def settle(self, requests: list[Request]) -> None:
        """After the output processor: the kept guesses that reached the output. A stop string,
        EOS or the budget may end the request inside a run, and what follows is never emitted."""
        for r in requests:
            if id(r) in self.kept:
                before, guessed, kept = self.kept.pop(id(r))
                kept = min(len(r.new_ids) - before, kept)
                r.num_accepted += kept
                if guessed and not r.finish_reason:     # did its guesses buy anything? (MAX_REST)
                    misses = 0 if kept else self.misses.get(r.id, 0) + 1
                    self.misses[r.id], self.resting[r.id] = misses, min(2 ** max(misses - 1, 0) - 1, MAX_REST)

    def release(self, request: Request) -> None:
        for memory in (self.misses, self.resting):
            memory.pop(request.id, None)
        self.proposer.release(request)
        self.runner.release(request)
# --8<-- [end:verify]

    # The rest is the wrapped runner's: its weights, its pool, its forward and its processes.
    @property
    def model(self) -> LlamaModel:
        return self.runner.model

    @property
    def kv(self):
        return self.runner.kv

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.runner.forward(*args, **kwargs)

    def warm_up(self) -> float:
        return self.runner.warm_up()

    def features(self) -> dict:
        return {**self.runner.features(), "speculative": self.name, "num_speculative_tokens": self.k}

    def close(self) -> None:
        self.runner.close()


# --8<-- [start:options]
class SpeculativeDecoding:
    """The engine's `speculative=` option as a feature it is handed, checked before any model
    loads. `build` makes the Speculator once the target is loaded: the n-gram lookup needs
    nothing; a draft model is loaded with the features it is given (by default the composition
    root hands this very model's folder and an int4 format, Chapter 12: a cheap self-draft) and
    gets a KV pool of the size the engine was asked for."""

    def __init__(self, method: str, num_speculative_tokens: int = 4, draft_model: str | None = None):
        if method is None:
            raise ValueError("speculative must be a method: " + ", ".join(SPECULATIVE_METHODS))
        for name, value in (("speculative", method), ("num_speculative_tokens", num_speculative_tokens),
                            ("draft_model", draft_model)):
            check_option(name, value)     # each against its row of the options table
        if draft_model is not None and method != "draft":
            raise ValueError("draft_model needs speculative='draft'")
        self.method, self.k, self.draft_model = method, num_speculative_tokens, draft_model

    def build(self, runner: ModelRunner, folder: Path, kv_memory: int, block_size: int,
              draft_features: Sequence = ()) -> Speculator:
        """The speculating runner over `runner` (the target's, already loaded)."""
        if self.method == "ngram":
            return Speculator(runner, self.method, NgramProposer(), self.k)
        target = runner.model
        folder = Path(resolve_model(self.draft_model)) if self.draft_model else Path(folder)
        model = load_model(folder, target.dtype, target.device, draft_features)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                             f"target's ({target.config.vocab_size}): it needs the same tokenizer")
        print(f"[engine] draft model: {folder.name} ({model.format_name or 'float'}), "
              f"{model.weight_bytes / 1e6:.0f} MB", flush=True)
        return Speculator(runner, self.method, DraftModelProposer(model, kv_memory, block_size), self.k)
# --8<-- [end:options]
