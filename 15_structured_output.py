"""15_structured_output.py - Chapter 11: output that always parses, by masking tokens at every step.

An application wants data back: a JSON object that matches a schema, a tool call, one word
from a list. Asked politely, a small model breaks the format often. Constrained decoding
makes it impossible to break: before each token is sampled, every token that would take the
text outside the language gets a logit of -inf, so the sampler can only pick tokens that keep
the text a valid *prefix*. When the language is complete, the only token left is EOS.

    allowed(prefix) = { t in vocabulary : prefix + text(t) is still a prefix of some valid output }

It has to work on tokens, not characters: one token can close a string and open the next
key (`",` `":"`), and the 49,152 tokens are all candidates at every step. Testing each one
against the grammar at each step (by hand, below) costs tens of milliseconds; xgrammar
(the library vLLM and SGLang use) compiles the vocabulary against the grammar once, so that
most tokens are decided ahead of time and a step's mask costs microseconds.

    python 15_structured_output.py            # the idea by hand, then xgrammar on the default model
    python 15_structured_output_demo.py       # free vs constrained: validity, and the cost of the mask

The engine's part lives in `minivllm/structured.py`: the grammar, the per-request constraint,
and `StructuredOutput`, the object an engine is handed when it is built (`LLM` and the server
pass it), so that no earlier chapter imports this one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch

from kit import cli
from minivllm.contracts import SamplingParams
from minivllm.output import pack_bits
from minivllm.structured import GrammarConstraint, StructuredOutput, compile_spec, compiler_for
from minivllm.text import render_chat


# --8<-- [start:by-hand]
def token_texts(tokenizer) -> list[str]:
    """Each token's text, decoded once: the by-hand 'compilation' of the vocabulary."""
    return tokenizer.batch_decode([[t] for t in range(len(tokenizer))])


class ChoiceByHand:
    """The smallest constrained language, one of a few strings, done by brute force.

    At each step every token of the vocabulary is tried: it is allowed when the text so far plus
    its text is still the start of some choice. Once the text is a whole choice, EOS is allowed
    too. The same interface as the xgrammar constraint below, so an engine can run either.
    """

    def __init__(self, choices: list[str], texts: list[str], eos_ids: set[int]):
        self.choices, self.texts, self.eos_ids = list(choices), texts, set(eos_ids)
        self.text, self.history, self.finished = "", [], False

    def allowed(self, token: int) -> bool:
        if token in self.eos_ids:
            return self.text in self.choices
        piece = self.texts[token]
        return bool(piece) and "\ufffd" not in piece and \
            any(c.startswith(self.text + piece) for c in self.choices)   # still a valid prefix

    def keep(self, vocab: int) -> torch.Tensor:
        """Which tokens may come next: a scan of the whole vocabulary."""
        return torch.tensor([self.allowed(t) for t in range(vocab)]) if not self.finished else \
            torch.zeros(vocab, dtype=torch.bool)

    def mask(self, logits: torch.Tensor) -> None:
        """-inf for every token that would leave the language."""
        logits.masked_fill_(~self.keep(logits.shape[-1]), float("-inf"))

    def fill_bitmask(self, words: torch.Tensor, row: int) -> None:
        """The same answer as 1 bit a token, in its row of the step's bitmask (what the engines read)."""
        words[row] = pack_bits(self.keep(len(self.texts)))[: words.shape[1]]

    def accept(self, token: int) -> bool:
        if not self.allowed(token):
            return False
        self.history.append(self.text)
        self.finished = token in self.eos_ids
        self.text += "" if self.finished else self.texts[token]
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self.text, self.finished = self.history.pop(), False
# --8<-- [end:by-hand]


def show_tokens_across_syntax(texts: list[str]) -> None:
    """Why it must work on tokens: single tokens that span JSON's punctuation."""
    found = [t for t in ('",', '":', '":"', '"},', '"]', '":[', '},{') if t in texts]
    print(f"  single tokens that end one JSON part and start the next: {found}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 11: constrained decoding, by hand then with xgrammar.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--max-new-tokens", type=cli.integer(1, 512), default=64)
    args = parser.parse_args()
    engine10 = importlib.import_module("10_model_engine")
    engine = engine10.ModelEngine(args.model, device=args.device, structured_output=StructuredOutput())
    tokenizer, eos = engine.tokenizer, engine.output.eos_token_ids

    print("[The idea by hand: one of a few strings, every token of the vocabulary tried at each step]")
    t0 = time.perf_counter()
    texts = token_texts(tokenizer)
    print(f"  decoding the {len(texts)} tokens once: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    show_tokens_across_syntax(texts)
    choices = ["positive", "negative", "neutral"]
    by_hand = ChoiceByHand(choices, texts, eos)
    t0 = time.perf_counter()
    allowed = [t for t in range(len(texts)) if by_hand.allowed(t)]
    print(f"  first step: {len(allowed)} of {len(texts)} tokens allowed, e.g. {[texts[t] for t in allowed[:8]]}; "
          f"the scan took {(time.perf_counter() - t0) * 1e3:.0f} ms")
    question = "Is this review positive, negative or neutral? 'The battery died in a day.' Answer in one word."
    prompt = render_chat(tokenizer, [{"role": "user", "content": question}])
    free = engine.generate(prompt, 16)
    print(f"  free answer:        {free.text!r}")
    forced = engine.generate(prompt, 16, SamplingParams(structured={"choice": choices}))
    print(f"  constrained answer: {forced.text!r} (finish_reason {forced.finish_reason})")

    print("\n[xgrammar: a JSON schema compiled against the vocabulary once, a bitmask per step]")
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
        "required": ["city", "country", "population_millions"]}
    spec = SamplingParams(structured={"json_schema": schema}).structured
    compiler_for(tokenizer, engine.output.vocab_size, tuple(sorted(eos)))   # the vocabulary, read once
    for label in ("compile", "compile again (cached)"):
        t0 = time.perf_counter()
        compiled = compile_spec(tokenizer, engine.output.vocab_size, tuple(sorted(eos)), spec)
        print(f"  {label:24s} {(time.perf_counter() - t0) * 1e3:7.2f} ms")
    constraint = GrammarConstraint(compiled, engine.output.vocab_size)
    t0 = time.perf_counter()
    n = int(constraint.allowed_mask().sum())
    print(f"  one step's mask: {n} tokens allowed at the start, in {(time.perf_counter() - t0) * 1e6:.0f} us")
    question = "Describe Paris as JSON with the keys city, country and population_millions."
    prompt = render_chat(tokenizer, [{"role": "user", "content": question}])
    for label, params in (("free", SamplingParams()), ("constrained", SamplingParams(structured={"json_schema": schema}))):
        result = engine.generate(prompt, args.max_new_tokens, params)
        try:
            json.loads(result.text)
            verdict = "parses"
        except ValueError:
            verdict = "does not parse"
        print(f"  {label:12s} {result.text.strip()!r}\n  {'':12s} -> {verdict}, finish_reason {result.finish_reason}")


if __name__ == "__main__":
    main()
