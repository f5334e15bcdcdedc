"""14_speculative_decoding.py - Chapter 10: guess several tokens cheaply, verify them in one forward.

At batch 1 a decode step reads every weight of the model to produce one token. Feeding it
k + 1 tokens instead costs almost the same: the weights are read once either way, and the
extra rows of each matmul are nearly free (Chapter 4's roofline). So if someone could *guess*
the next k tokens, one forward of the model could check all of them at once:

    propose   a cheap drafter guesses d1 .. dk after the text so far
    verify    the model runs on [last, d1 .. dk]: k + 1 positions, k + 1 next-token distributions
    accept    keep d1, d2, ... while the model agrees; at the first disagreement take the
              model's own token instead. Every verification yields 1 .. k + 1 tokens.

Two drafters: prompt lookup (the last few tokens appeared earlier in the prompt or the
output: propose what followed them; free, and strong when the answer copies its input) and a
draft model (any model with the same tokenizer: by default this same model on Chapter 12's
int4 weights, with its own KV pool, catching up on the tokens the target kept).

The output does not change. Greedy: a guess is kept only if it *is* the model's argmax.
Sampling: the model's token at each position is drawn with the Gumbel-max trick from noise
made of the request's seed and the position (`draw`), and a guess is kept only if it *is* that
token; a draft model draws its guesses with the same noise, so it agrees where its distribution
is close. Every token is an exact sample of p, the same whatever was guessed, so a seeded
request samples the same text in any batch.

In the assembled engine (Chapter 9) speculation is a switch with the same names as the flags:

    python 14_speculative_decoding.py                          # one prompt, as 04_engine.py, prompt lookup
    python 14_speculative_decoding.py --speculative draft      # ... guessed by this model on int4 weights
    python 14_speculative_decoding_demo.py          # a request's guesses step by step, then the table
    python 05_server.py --engine minivllm:LLM --speculative draft
"""

from __future__ import annotations

from kit.demo import engine_main
from minivllm.llm import LLM
from minivllm.speculative import COPYING_PROMPT

# The guessers, the verification and the option live in minivllm/speculative.py; LLM wires them.


def main() -> None:
    engine, _, _ = engine_main(LLM, "Chapter 10: the assembled engine, guessing and verifying.",
                               speculative="ngram", prompt=COPYING_PROMPT)
    print(f"  {'features':<15} {engine.features()}")
    engine.close()


if __name__ == "__main__":
    main()
