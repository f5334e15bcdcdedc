"""Chapter 16: many answers from one prompt. Parallel sampling and best-of on shared blocks.

A request for n answers (`SamplingParams(n=...)`) is n sequences that share a prompt. The first
is prefilled alone, up to its prompt's last token; then the scheduler forks the others onto its
blocks (`Scheduler.fork`): each holds every prompt block by reference count, and none is copied,
until a sequence writes into a block someone else still holds (`BlockManager.own`): the prompt's
last, partly filled block, copied once per answer but the last (copy-on-write, as the
PagedAttention paper does). Each answer computes that last prompt token itself and draws its
first token with its own noise (noise keyed on seed, choice and position: choice 0 is what the
same request with n = 1 gives). From then on each is an ordinary sequence: it grows, is
preempted, finishes and is freed on its own; an abort stops them all.

`best_of` (OpenAI's legacy completions) generates best_of answers and keeps the n with the
highest mean log-probability per token. This module builds the members of a group and turns
a finished group into one result whose `outputs` hold the n answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minivllm.contracts import CompletionOutput, GenerateResult, RequestMetrics, is_integer
from minivllm.output import OutputProcessor, Request, logprob_tokens


# --8<-- [start:group]
class ManyAnswersOutput(OutputProcessor):
    """Chapter 2's output processor, for requests that ask for several answers to one prompt."""

    forks = True

    def request_for(self, prompt, max_new_tokens: int, params, context_length: int,
                    arrival: float | None = None) -> Request:
        """The request for choice 0, carrying its siblings: built now, forked onto its blocks later."""
        r = super().request_for(prompt, max_new_tokens, params, context_length, arrival)
        k = r.params.num_sequences
        if k > 1:
            members = [r] + [self.new_request(r.prompt_ids, r.params, r.budget, r.arrival) for _ in range(1, k)]
            for i, m in enumerate(members):
                m.group, m.choice, m.seed, m.prompt = members, i, r.seed, r.prompt   # one seed, n choices
                if ranks_by_logprob(r) and m.logprobs is None:
                    m.logprobs = []                  # best_of ranks by them, asked for or not
            r.siblings = members[1:]
        return r

    def result(self, r: Request) -> GenerateResult:
        """One result for a group: `outputs` holds its answers (best_of: the n best), the top-level
        fields read as outputs[0], and the metrics count every token generated."""
        if r.group is None:
            return super().result(r)
        chosen = best(r.group, r.params.n) if ranks_by_logprob(r) else r.group
        outputs = [completion(i, m, OutputProcessor.result(self, m)) for i, m in enumerate(chosen)]
        first, total = outputs[0], sum(len(m.new_ids) for m in r.group)
        t_first = min(m.t_first for m in r.group if m.t_first) if total else r.arrival
        t_last = max(m.t_last for m in r.group)
        metrics = RequestMetrics(
            throughput=total / max(t_last - r.arrival, 1e-9), input_tokens=r.n_prompt, output_tokens=total,
            ttft_ms=(t_first - r.arrival) * 1e3,
            queue_ms=None if r.admitted is None else (r.admitted - r.arrival) * 1e3, cached_tokens=r.cached_tokens)
        return GenerateResult(text=first.text, output_ids=first.token_ids, metrics=metrics,
                              finish_reason=first.finish_reason, logprobs=first.logprobs, prompt=r.prompt,
                              prompt_token_ids=list(r.prompt_ids), outputs=outputs, stop_reason=first.stop_reason)
# --8<-- [end:group]


# --8<-- [start:best-of]
def ranks_by_logprob(r: Request) -> bool:
    return r.params.best_of is not None and r.params.best_of > r.params.n


def mean_logprob(m: Request) -> float:
    """OpenAI's best_of rule: the highest log-probability per token (of the text returned)."""
    kept = m.logprobs[:logprob_tokens(m)]
    return sum(e.logprob for e in kept) / max(len(kept), 1)


def best(members: list[Request], n: int) -> list[Request]:
    """The n answers with the highest mean log-probability per token, best first (ties: by choice)."""
    return sorted(members, key=lambda m: (-mean_logprob(m), m.choice))[:n]
# --8<-- [end:best-of]


def completion(index: int, m: Request, result: GenerateResult) -> CompletionOutput:
    """One member's answer in vLLM's shape; its log-probabilities only where the request asked."""
    asked = m.params.logprobs is not None
    computed = result.logprobs is not None
    return CompletionOutput(index, result.text, result.output_ids, result.finish_reason,
                            sum(e.logprob for e in result.logprobs) if computed else None,
                            result.logprobs if asked else None, result.stop_reason)


# --8<-- [start:beam-params]
MAX_BEAM_WIDTH = 10   # 2 x width candidates a step, read from one step's top log-probabilities (at most 20)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search settings: keep the beam_width likeliest sequences at every step.
    length_penalty as HF defines it: a finished beam scores sum(log p) / length ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not is_integer(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError("beam search here is deterministic: temperature must be 0")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam, in vLLM's names: `tokens` are the prompt's and the answer's; `text` is the answer's."""

    tokens: list[int]
    output_ids: list[int]
    cum_logprob: float
    score: float                  # cum_logprob / len(output_ids) ** length_penalty: what ranks the beams
    text: str = ""
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # the beam_width best, best first
# --8<-- [end:beam-params]


# --8<-- [start:beam-search]
def beam_search(generate_step, prompt_ids: list[int], params: BeamSearchParams, eos_ids: set[int],
                on_step=None) -> list[tuple[float, float, list[int], str]]:
    """HF's beam search (`generate(num_beams=k, do_sample=False)`, early_stopping=False), one step at a
    time: every running beam's next-token log-probabilities (`generate_step`: one engine step over
    all beams, each its own sequence, a prefix cache sharing what they have in common), the best 2k
    continuations over all beams, those ending in EOS among the best k finished (scored with the
    length penalty), the best k others kept; the rest are pruned and their blocks given back.
    Returns the k best (score, cum_logprob, output ids, finish_reason), best first."""
    k, lp = params.beam_width, params.length_penalty
    eos = set() if params.ignore_eos else eos_ids
    keep = max(2, 1 + len(eos)) * k
    running = [(torch.tensor(0.0), [])]               # (sum of log p in float32, as HF adds them; ids)
    finished: list[tuple[float, float, list[int], str]] = []
    for step in range(params.max_tokens):
        tops = generate_step([prompt_ids + ids for _, ids in running], keep)
        candidates = [(total + lp_, ids + [token]) for (total, ids), top in zip(running, tops)
                      for token, lp_ in top]
        candidates.sort(key=lambda c: -float(c[0]))   # stable: ties keep beam order, then token rank
        candidates, last = candidates[:keep], step == params.max_tokens - 1
        length = step + 1
        for rank, (total, ids) in enumerate(candidates[:k]):   # only the best k may finish this step
            if last or ids[-1] in eos:
                finished.append((float(total / length ** lp), float(total), ids, "stop" if ids[-1] in eos else "length"))
        finished = sorted(finished, key=lambda f: -f[0])[:k]
        running = [(t, ids) for t, ids in candidates if ids[-1] not in eos][:k]
        if on_step:
            on_step(step, running, finished)
        if last or not running:
            break
        best_possible = float(running[0][0] / length ** lp)   # HF's heuristic for early_stopping=False
        if len(finished) == k and best_possible <= finished[-1][0]:
            break
    return finished
# --8<-- [end:beam-search]
