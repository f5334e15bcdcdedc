"""10_model_runner.py - Chapter 6: the model runner. Weights, KV storage, and one step.

An engine does two different jobs: deciding *what* to compute (which requests, which of
their tokens) and computing it. The model runner is the second job, on its own:

    weights     a LlamaModel (10_model.py), in whatever format it was given
    KV storage  where keys and values live: Chapter 6's contiguous rows, Chapter 7's pool of blocks
    one step    prepare -> forward -> sample
                prepare  the step's new tokens of several requests become one ragged batch
                         (positions, and the slot where each new key/value is written)
                forward  the model over that batch, reading and writing the KV storage
                sample   one token for each request whose known tokens are now all computed
                         (a chunk in the middle of a long prompt predicts nothing yet)

The runner knows nothing of queues, budgets, text or stop strings: the engine decides,
the runner computes. Later chapters change the runner by composition: Chapter 7 hands
it a pool of blocks instead of rows, Chapter 12 a model with quantised weights.

    python 10_model_runner.py      # a runner stepped by hand: one prefill, then decode steps
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

import torch

from kit import cli, plugins

setup = importlib.import_module("01_setup")
engine04 = importlib.import_module("04_engine")
decode_loop = importlib.import_module("07_decode_loop")
model10 = importlib.import_module("10_model")
Request = decode_loop.Request


# --8<-- [start:load]
def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu", quant: str | None = None,
               group_size: int = 32, quant_head: str = "auto", compile: bool = False) -> model10.LlamaModel:
    """The weights a runner computes with: the model's own, or in a weight format (Chapter 12)
    swapped in module by module once they are loaded, as gpt-fast's quantize.py does; with
    compile=True, packed for their kernels and run by a compiled forward (Chapter 13)."""
    to_format = None
    if quant is not None:    # checked before the weights load: a typo costs nothing
        to_format = plugins.plugin("weight_format")(quant, group_size, quant_head)
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    model = model10.LlamaModel.from_folder(folder, dtype, device)
    model = to_format(model) if to_format else model
    return plugins.plugin("compile")(model) if compile else model
# --8<-- [end:load]


# --8<-- [start:runner]
class ModelRunner:
    """Owns the weights and the KV storage; runs one step of any mix of prefills and decodes."""

    def __init__(self, model: model10.LlamaModel, kv):
        self.model, self.kv = model, kv        # kv: a KVCache (rows) or a KVPool (blocks)

    def prepare(self, requests: list[Request], starts: list[int], lengths: list[int],
                places: list) -> model10.RaggedBatch:
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
        logits = self.forward(requests, starts, lengths, places)
        ready = [i for i, (r, s, n) in enumerate(zip(requests, starts, lengths)) if s + n == r.num_tokens]
        tokens: list[int | None] = [None] * len(requests)
        if ready:
            for i, token in zip(ready, decode_loop.sample(logits[ready], [requests[i] for i in ready])):
                tokens[i] = token
        return tokens
# --8<-- [end:runner]


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="Chapter 6: a model runner stepped by hand.")
    cli.add_model_flags(parser, device=False)
    parser.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
    args = parser.parse_args()
    folder = setup.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_model(folder)
    output = decode_loop.OutputProcessor(tokenizer, {tokenizer.eos_token_id}, model.config.vocab_size, "cpu")
    prompts = ["The capital of France is", "One, two, three,"]
    requests = [output.new_request(tokenizer(p).input_ids, engine04.SamplingParams(ignore_eos=True), args.steps + 1)
                for p in prompts]
    runner = ModelRunner(model, model.new_cache(len(requests), 64))   # request i owns cache row i
    print("step  kind     tokens fed (per request)   new tokens")
    for step in range(args.steps + 1):
        starts = [r.num_computed for r in requests]
        lengths = [r.num_tokens - r.num_computed for r in requests]
        t = time.perf_counter()
        tokens = runner.step(requests, starts, lengths, places=[0, 1])
        ms = (time.perf_counter() - t) * 1e3
        for r, token in zip(requests, tokens):
            r.num_computed = r.num_tokens
            output.accept(r, token, time.perf_counter())
        kind = "prefill" if step == 0 else "decode"
        print(f"{step:>4}  {kind:<8} {str(lengths):<26} {[tokenizer.decode([t]) for t in tokens]}  ({ms:.0f} ms)")
    for p, r in zip(prompts, requests):
        print(f"\n{p!r} -> {r.detok.text!r}")


if __name__ == "__main__":
    main()
