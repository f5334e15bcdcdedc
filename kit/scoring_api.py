"""kit/scoring_api.py - scoring a prompt through /v1/completions, as OpenAI's legacy API and vLLM spell it.

An evaluation harness (lm-evaluation-harness's `local-completions`) asks how likely each answer
is after its question: it sends question + answer with `echo: true` and `logprobs: k`, and reads
back every prompt token's log-probability (the first is null: nothing comes before it) with its
k likeliest alternatives. `max_tokens: 0` with `echo` scores without generating anything; vLLM's
`prompt_logprobs: k` extra returns the same numbers in vLLM's shape (a dict per prompt token,
keyed by token id). The engine computes them in the prefill it runs anyway
(minivllm/prompt_logprobs.py); this file only reads the request and shapes the answer.
"""

from __future__ import annotations


class ScoringError(ValueError):
    """A scoring request that cannot be served as sent; its first word is the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if not message.startswith(field) else message)
        self.field = field


# --8<-- [start:request]
def prompt_logprobs(req) -> int | None:
    """How many alternatives each prompt token's entry carries; None: the prompt is not scored.
    `prompt_logprobs` (vLLM's) says it directly; `echo` with `logprobs` (OpenAI's legacy) says it too."""
    asked = getattr(req, "prompt_logprobs", None)
    if asked is None and getattr(req, "echo", False) and req.logprobs is not None:
        asked = req.logprobs
    return asked


def check(req) -> bool:
    """Refuse what cannot be scored; True when the request only scores (max_tokens 0, with echo)."""
    echo = getattr(req, "echo", False)   # completions' (chat has no echo)
    scored_only = req.max_tokens == 0
    if scored_only and not echo:
        raise ScoringError("max_tokens", "max_tokens 0 generates nothing: it only makes sense with echo "
                                         "(score the prompt); send max_tokens >= 1")
    if req.stream and (echo or req.prompt_logprobs is not None):
        raise ScoringError("echo" if echo else "prompt_logprobs",
                           "scoring a prompt is answered whole: send it with stream false")
    return scored_only
# --8<-- [end:request]


# --8<-- [start:answer]
def echoed(choice: dict, result, prompt, tokenizer, scored_only: bool, echo: bool, vllm_field: bool,
           logprob=float) -> dict:
    """A completions choice with the prompt in front (echo), its tokens' log-probabilities first in
    `logprobs`, and vLLM's `prompt_logprobs`; scored_only: the one token generated to run the
    prefill is dropped, as if none were (max_tokens 0)."""
    if scored_only:
        choice.update(text="", finish_reason="length")
        if choice["logprobs"] is not None:
            choice["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    entries = result.prompt_logprobs
    if vllm_field:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(result, tokenizer, logprob)
    if not echo:
        return choice
    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
    choice["text"] = text + choice["text"]
    if choice["logprobs"] is not None and entries is not None:
        ids = result.prompt_token_ids
        tokens = [tokenizer.decode([t]) for t in ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        after = choice["logprobs"]
        choice["logprobs"] = {
            "tokens": tokens + after["tokens"],
            "token_logprobs": [None if e is None else logprob(e.logprob) for e in entries] + after["token_logprobs"],
            "top_logprobs": [None if e is None else {tokenizer.decode([t]): logprob(lp) for t, lp in e.top}
                             for e in entries] + after["top_logprobs"],
            "text_offset": offsets + [len(text) + o for o in after["text_offset"]]}
    return choice


def vllm_prompt_logprobs(result, tokenizer, logprob=float) -> list | None:
    """vLLM's `prompt_logprobs` of one answer: None, then one dict per prompt token."""
    entries = result.prompt_logprobs
    return None if entries is None else [vllm_entry(e, tokenizer, logprob) for e in entries]


def vllm_entry(entry, tokenizer, logprob=float) -> dict | None:
    """vLLM's shape of one prompt token's entry: {token id: {logprob, rank, decoded_token}}, the
    token itself and its alternatives (rank: its place among them, null if it is not one)."""
    if entry is None:
        return None
    rank = {t: i + 1 for i, (t, _) in enumerate(entry.top)}
    return {str(t): {"logprob": logprob(lp), "rank": rank.get(t), "decoded_token": tokenizer.decode([t])}
            for t, lp in ((entry.token_id, entry.logprob), *entry.top)}   # the token first, as vLLM's
# --8<-- [end:answer]
