"""04_hf_hooks.py - the hooks that make Hugging Face's `generate` serve Chapter 1's contract.

`BaselineEngine` hands the whole token loop to `model.generate`. These small classes plug
into the extension points it offers (logits processors, a streamer, stopping criteria), so
that the black box still honours everything `SamplingParams` asks for and can be streamed
and stopped:

- `RawLogprobs` keeps each step's untouched logits, for log-probabilities;
- `OutputPenalties` adds OpenAI's presence and frequency penalties, which HF lacks;
- `TokenQueueStreamer` hands each new token to another thread as it is chosen;
- `CancelCriteria` and `StopTextCriteria` end the loop from outside, or at a stop string.
"""

from __future__ import annotations

import queue
import threading

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from kit import cli
from minivllm.contracts import SamplingParams, TokenLogprob
from minivllm.model_files import load_hf_model
from minivllm.sampling import apply_presence_frequency, token_logprobs


# --8<-- [start:hf-processors]
class RawLogprobs(LogitsProcessor):
    """First in HF's list, so it sees each step's logits before anything changes them."""

    def __init__(self, k: int):
        self.k, self.rows = k, []

    def __call__(self, input_ids, scores):
        self.rows.append(scores[:1].clone())   # one request: row 0; kept until its token is known
        return scores

    def entry(self, token_id: int) -> TokenLogprob:
        return token_logprobs(self.rows.pop(0), [token_id], [self.k])[0]


class OutputPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, which HF does not have: Chapter 1's function."""

    def __init__(self, params: SamplingParams, n_prompt: int):
        self.params, self.n_prompt = params, n_prompt

    def __call__(self, input_ids, scores):
        counts = torch.stack([torch.bincount(row[self.n_prompt:], minlength=scores.shape[-1]).float()
                              for row in input_ids])
        p = self.params
        return apply_presence_frequency(scores, counts, p.presence_penalty, p.frequency_penalty)
# --8<-- [end:hf-processors]


class TokenQueueStreamer(BaseStreamer):
    """Hands each new token id from HF's generate thread to the consumer through a queue.

    With a RawLogprobs recorder it also pairs each token with its log-probability
    (the i-th entry is ready before the i-th token is queued).
    """

    def __init__(self, recorder: RawLogprobs | None = None):
        self.tokens: queue.Queue = queue.Queue()
        self.recorder, self.logprobs = recorder, ([] if recorder else None)
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first reports the prompt itself
            self._prompt_seen = True
            return
        for token_id in value.reshape(-1).tolist():
            if self.recorder:
                self.logprobs.append(self.recorder.entry(token_id))
            self.tokens.put(token_id)

    def end(self) -> None:
        self.tokens.put(None)


class CancelCriteria(StoppingCriteria):
    """Lets another thread stop HF's loop, e.g. when a streaming client has gone away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool,
                          device=input_ids.device)


class StopTextCriteria(StoppingCriteria):
    """Ends HF's loop once our detokenizer has seen a stop string (one request, batch of one).

    HF's own stop_strings builds and caches tables that grow with each string; the
    detokenizer the streaming path already uses costs nothing that outlives the request.
    """

    def __init__(self, detok, n_prompt: int):   # detok: an IncrementalDetokenizer (minivllm/text.py)
        self.detok, self.n_prompt = detok, n_prompt

    def __call__(self, input_ids, scores, **kwargs):
        for token_id in input_ids[0, self.n_prompt + len(self.detok.ids):].tolist():
            self.detok.add(token_id)
        return torch.full((input_ids.shape[0],), self.detok.stopped, dtype=torch.bool, device=input_ids.device)


def main() -> None:
    """The hooks on HF's generate directly: a presence penalty, raw log-probabilities, a stream."""
    import argparse

    parser = argparse.ArgumentParser(description="HF generate with the hooks that serve SamplingParams.")
    cli.add_model_flags(parser, device=False)
    parser.add_argument("--prompt", default="The three primary colours are")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args()
    tokenizer, model = load_hf_model(args.model, "cpu", torch.float32)
    params = SamplingParams(presence_penalty=1.5, logprobs=2)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    recorder = RawLogprobs(params.logprobs)
    streamer = TokenQueueStreamer(recorder)
    with torch.no_grad():
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                       max_new_tokens=args.max_new_tokens, streamer=streamer,
                       logits_processor=[recorder, OutputPenalties(params, input_ids.shape[1])])
    print(f"[Prompt] {args.prompt!r}  (greedy, presence_penalty={params.presence_penalty})")
    for entry in streamer.logprobs:   # generate() has finished: every token and its entry are recorded
        top = ", ".join(f"{tokenizer.decode([t])!r} {lp:.2f}" for t, lp in entry.top)
        print(f"  {tokenizer.decode([entry.token_id])!r:>14}  logprob {entry.logprob:6.2f}   top: {top}")


if __name__ == "__main__":
    main()
