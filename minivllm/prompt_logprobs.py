"""Chapter 6: prompt scoring. Every prompt token's log-probability, from the prefill that runs anyway.

A prefill computes a hidden state at every prompt position, but to pick the next token only
the last one goes through the lm_head. Position p's logits also say how likely the model found
token p + 1, so scoring a prompt (an evaluation harness asks how likely each answer is after
its question) costs no extra forward: only more rows of the lm_head, for the requests that ask
(`SamplingParams.prompt_logprobs`). Every other request keeps its one row, so a step without
such a request runs exactly as before.

A chunked prefill scores each chunk's tokens as it runs; the last position of the last chunk
is the one that samples. A prefix cache keeps K/V but not logits, so a request that scores its
prompt shares no cached block (minivllm/output.py: `Request.cache_salt`).
"""

from __future__ import annotations

import torch

from minivllm import sampling
from minivllm.output import Request


# --8<-- [start:rows]
def next_scored(r: Request) -> int | None:
    """The prompt position whose token r scores next (None: it asks for none, or has them all)."""
    if r.prompt_logprobs is None or len(r.prompt_logprobs) >= r.n_prompt:
        return None
    return len(r.prompt_logprobs)   # token 0 has nothing before it: the list starts [None]


def scores(r: Request, start: int, n: int) -> bool:
    """Does the chunk [start, start + n) hold the position whose logits score r's next prompt token?"""
    p = next_scored(r)
    if p is None or p - 1 >= start + n:   # none, or a later chunk's
        return False
    if p - 1 < start:   # its logits were never computed (only a cached prefix could skip them)
        raise RuntimeError(f"request {r.id}: position {p - 1}'s logits were skipped; prompt scoring needs them")
    return True


def logit_rows(requests: list[Request], starts: list[int], lengths: list[int]) -> list[int] | None:
    """How many rows of logits each request needs this step: its whole chunk where it scores prompt
    tokens in it, else 1 (its last position). None when nobody scores: the model's own default."""
    if all(r.prompt_logprobs is None for r in requests):   # the usual step: one look at each request
        return None
    rows = [n if scores(r, s, n) else 1 for r, s, n in zip(requests, starts, lengths)]
    return rows if any(scores(r, s, n) for r, s, n in zip(requests, starts, lengths)) else None
# --8<-- [end:rows]


# --8<-- [start:record]
def record(logits: torch.Tensor, requests: list[Request], starts: list[int], lengths: list[int],
           rows: list[int]) -> torch.Tensor:
    """Score the prompt tokens each chunk predicts (row j of request i's block is position
    starts[i] + j, which scores token starts[i] + j + 1); return each request's last row,
    the one its next token is sampled from, as a step without scoring would have it."""
    blocks = logits.split(rows)
    for r, s, n, block in zip(requests, starts, lengths, blocks):
        if len(block) == n and scores(r, s, n):
            first, end = next_scored(r), min(s + n, r.n_prompt - 1) + 1   # tokens first .. end - 1
            targets = r.prompt_ids[first:end]
            k = r.params.prompt_logprobs
            r.prompt_logprobs.extend(sampling.token_logprobs(block[first - 1 - s:end - 1 - s], targets,
                                                             [k] * len(targets)))
    return torch.stack([block[-1] for block in blocks])
# --8<-- [end:record]
