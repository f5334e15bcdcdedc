"""02_sampling.py - from next-token logits to a token id, one visible step at a time.

A language model does not output text. For each position it outputs one score
(a logit) per vocabulary entry. Decoding is the small piece of code that turns
those scores into a choice. Every decoding strategy in this book is a mix of four
plain torch functions:

    greedy            take the argmax
    apply_temperature divide the logits: < 1 sharpens, > 1 flattens
    top_k_filter      keep the k highest-scoring tokens
    top_p_filter      keep the smallest set of tokens whose probability reaches p

`sample_next_token` chains them in the usual order (temperature, top-k, top-p,
then one seeded draw). Chapter 2's decode loop calls it at every step.

Before those, OpenAI's API lets a request adjust the logits themselves, and each
adjustment needs to know what the request has seen so far (`TokenHistory`):

    logit_bias          add a fixed amount to chosen tokens' logits
    repetition_penalty  shrink the logits of every token already seen, prompt included
    presence_penalty    subtract once from each token already in the output
    frequency_penalty   subtract once per time a token occurs in the output

`adjust_logits` applies them to a whole batch at once, one row per request, in the
order HF's generate uses; `token_logprobs` reports how likely the chosen tokens were.

    python 02_sampling.py --prompt "The capital of France is"
"""

from __future__ import annotations

import argparse

import torch

from kit import cli   # flags checked as they are parsed
from minivllm import contracts
from minivllm.model_files import load_hf_model
from minivllm.sampling import (TokenHistory, adjust_logits, apply_temperature, greedy, make_generator,
                               sample_next_token, top_k_filter, top_p_filter)


# ---------------------------------------------------------------- the demonstration
def next_token_logits(tokenizer, model, prompt: str) -> torch.Tensor:
    """One forward pass over the prompt; the last position's logits predict the next token."""
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        return model(input_ids).logits[0, -1].float().cpu()


def show(tokenizer, title: str, before: torch.Tensor, after: torch.Tensor, rows: int = 8) -> None:
    """Print the top candidates with their probability before and after a transformation."""
    p_before, p_after = before.softmax(-1), after.softmax(-1)
    kept = int(torch.isfinite(after).sum())
    print(f"\n[{title}]  ({kept} of {after.numel()} tokens keep a non-zero probability)")
    print(f"  {'rank':>4}  {'token':<14} {'id':>6}  {'p before':>9}  {'p after':>9}")
    for rank, token_id in enumerate(torch.topk(before, rows).indices.tolist(), start=1):
        token = repr(tokenizer.decode([token_id]))
        print(f"  {rank:>4}  {token:<14} {token_id:>6}  {p_before[token_id]:>9.4f}  {p_after[token_id]:>9.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Sampling made visible on the model's next-token logits.")
    cli.add_model_flags(parser, device=False)
    parser.add_argument("--prompt", default="My favourite hobby is")
    parser.add_argument("--seed", type=cli.integer(*contracts.SEED_RANGE), default=0)
    args = parser.parse_args()
    if not args.prompt:
        parser.error("--prompt must not be empty")
    try:
        tokenizer, model = load_hf_model(args.model, device=torch.device("cpu"))
    except ValueError as exc:
        parser.error(str(exc))
    logits = next_token_logits(tokenizer, model, args.prompt)
    print(f"[Prompt]\n  {args.prompt!r}")

    # --8<-- [start:demo]
    token_id = int(greedy(logits))
    print(f"\n[greedy]  argmax -> {tokenizer.decode([token_id])!r} (id {token_id})")
    show(tokenizer, "temperature 0.5: sharper", logits, apply_temperature(logits, 0.5))
    show(tokenizer, "temperature 1.5: flatter", logits, apply_temperature(logits, 1.5))
    show(tokenizer, "top-k 3: only three survive", logits, top_k_filter(logits, 3))
    show(tokenizer, "top-p 0.8: smallest set reaching 80%", logits, top_p_filter(logits, 0.8))

    def adjusted(params, history):   # one request, so a batch of one row
        return adjust_logits(logits.unsqueeze(0), [params], [history])[0]

    history = TokenHistory(tokenizer(args.prompt).input_ids, logits.numel())
    ban = contracts.SamplingParams(logit_bias={token_id: -100})
    show(tokenizer, f"logit_bias {{{token_id}: -100}}: the favourite is banned", logits, adjusted(ban, history))
    history.add(token_id)             # pretend the answer so far already used the favourite twice
    history.add(token_id)
    show(tokenizer, "frequency_penalty 1.0 once the favourite came out twice", logits,
         adjusted(contracts.SamplingParams(frequency_penalty=1.0), history))

    params = contracts.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=args.seed)
    draws = [sample_next_token(logits, params, make_generator(params.seed)) for _ in range(3)]
    print(f"\n[seeded draw]  {params}")
    print(f"  the same seed three times -> {[tokenizer.decode([t]) for t in draws]}")
    generator = make_generator(params.seed)
    ten = [tokenizer.decode([sample_next_token(logits, params, generator)]) for _ in range(10)]
    print(f"  ten draws from one stream -> {ten}")
    # --8<-- [end:demo]


if __name__ == "__main__":
    main()
