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
the runner computes. It lives in the engine's package (`minivllm/model_runner.py`); this
script steps one by hand.

    python 10_model_runner.py      # a runner stepped by hand: one prefill, then decode steps
"""

from __future__ import annotations

import argparse
import time

from kit import cli
from minivllm.contracts import SamplingParams
from minivllm.model_files import resolve_model
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import OutputProcessor


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="Chapter 6: a model runner stepped by hand.")
    cli.add_model_flags(parser, device=False)
    parser.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_model(folder)
    output = OutputProcessor(tokenizer, {tokenizer.eos_token_id}, model.config.vocab_size, "cpu")
    prompts = ["The capital of France is", "One, two, three,"]
    requests = [output.new_request(tokenizer(p).input_ids, SamplingParams(ignore_eos=True), args.steps + 1)
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
