"""Chapter 6: the model runner. Weights, KV storage, and one step.

An engine does two jobs: deciding *what* to compute (which requests, which of their tokens)
and computing it. The model runner is the second job, on its own:

    prepare  the step's new tokens of several requests become one ragged batch
             (positions, and the slot where each new key/value is written)
    forward  the model over that batch, reading and writing the KV storage
    sample   one token for each request whose known tokens are now all computed
             (a chunk in the middle of a long prompt predicts nothing yet)

It knows nothing of queues, budgets, text or stop strings: the engine decides, the runner
computes. Later chapters change it by composition: Chapter 7 hands it a pool of blocks
instead of rows, Chapter 12 a model with quantised weights, Chapter 14 a group of processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from minivllm import prompt_logprobs
from minivllm.model import LlamaModel, RaggedBatch
from minivllm.output import Request, sample

# --8<-- [start:load]
def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
               features: Sequence[Callable[[LlamaModel], LlamaModel]] = ()) -> LlamaModel:
    """The weights a runner computes with: the model's own, then changed by each feature in
    turn, as gpt-fast's quantize.py swaps modules once they are loaded. A feature is an object
    that takes a model and returns one with other weights (or another forward): a weight
    format (Chapter 12), compiled steps (Chapter 13), a tensor-parallel shard (Chapter 14).
    A feature that needs only part of each tensor says which (`part`, the shard's slices), and
    only that part is read from the files. Features check their settings when they are made,
    so a typo costs no load."""
    parts = [feature.part for feature in features if hasattr(feature, "part")]
    if len(parts) > 1:
        raise ValueError("load_model: more than one feature asks for part of each tensor")
    model = LlamaModel.from_folder(folder, dtype, device, parts[0] if parts else None)
    for feature in features:
        model = feature(model)
    return model
# --8<-- [end:load]


# --8<-- [start:runner]
class ModelRunner:
    """Owns the weights and the KV storage; runs one step of any mix of prefills and decodes."""

    def __init__(self, model: LlamaModel, kv):
        self.model, self.kv = model, kv        # kv: a KVCache (rows) or a KVPool (blocks)

    def prepare(self, requests: list[Request], starts: list[int], lengths: list[int],
                places: list) -> RaggedBatch:
        """Request i feeds its tokens [starts[i], starts[i] + lengths[i]); places[i] is where its
        K/V live in the storage (a row, or a block table)."""
        new_tokens = [r.tokens(s, n) for r, s, n in zip(requests, starts, lengths)]
        return self.kv.batch(new_tokens, places, starts, self.model.device)

    def forward(self, requests: list[Request], starts: list[int], lengths: list[int], places: list,
                num_logits: list[int] | None = None) -> torch.Tensor:
        """prepare -> forward: the logits of each request's last token fed (or of its last
        num_logits[i] tokens: a speculative verification, Chapter 10)."""
        return self.model.forward(self.prepare(requests, starts, lengths, places), self.kv, num_logits=num_logits)

    def step(self, requests: list[Request], starts: list[int], lengths: list[int],
             places: list) -> list[int | None]:
        """prepare -> forward -> sample. The next token of each request whose known tokens are all
        computed after this step; None for a request still in the middle of its prompt."""
        rows = prompt_logprobs.logit_rows(requests, starts, lengths)   # None unless a prompt is scored
        logits = self.forward(requests, starts, lengths, places, rows)
        if rows is not None:
            logits = prompt_logprobs.record(logits, requests, starts, lengths, rows)
        ready = [i for i, (r, s, n) in enumerate(zip(requests, starts, lengths)) if s + n == r.num_tokens]
        tokens: list[int | None] = [None] * len(requests)
        if ready:
            for i, token in zip(ready, sample(logits[ready], [requests[i] for i in ready])):
                tokens[i] = token
        return tokens

    def warm_up(self) -> float:
        """Build whatever a model builds before serving (compiled kernels, Chapter 13) on this
        runner's pool; seconds it took, 0 for a model with nothing to build."""
        warm_up = getattr(self.model, "warm_up", None)
        return warm_up(self.kv) if warm_up is not None else 0.0
# --8<-- [end:runner]

    # --8<-- [start:engine-side]
    # What the engine's step asks of any runner. This one computes one token a request; Chapter
    # 10's speculating runner (minivllm/speculative.py) answers the same four calls with guesses.
    def propose(self, work, max_num_batched_tokens: int) -> None:
        """Before the step: guesses to verify in it (`draft_ids`). A plain runner makes none."""

    def run(self, requests: list[Request], starts: list[int], lengths: list[int],
            places: list) -> list[list[int] | None]:
        """The tokens each request gains this step: one, or None for a prefill's middle chunk."""
        return [None if t is None else [t] for t in self.step(requests, starts, lengths, places)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Before the step: the block copies that copy-on-write owes (Chapter 16)."""
        self.kv.copy_blocks(copies)

    def settle(self, requests: list[Request]) -> None:
        """After the output processor has taken the step's tokens. Nothing to count here."""

    def admit(self, request: Request) -> None:
        """The request enters the engine (the loop's thread): a built request that never gets
        here, refused with its batch, holds nothing."""

    def release(self, request: Request) -> None:
        """The request left the engine: nothing is held for it here."""

    def features(self) -> dict:
        """What this runner adds to the engine's description (the server's page, /metrics)."""
        return {}

    def close(self) -> None:
        """Stop whatever the runner started: here, nothing (a tensor-parallel group has processes)."""
    # --8<-- [end:engine-side]
