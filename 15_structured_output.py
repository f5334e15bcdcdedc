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

Every engine that samples with Chapter 2's `sample` (07_decode_loop.py) honours
`SamplingParams(structured=...)`: the request carries the constraint made here, found through
kit/plugins.py, so no earlier chapter imports this one.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import re
import time

import torch
from transformers import LogitsProcessor

from kit import cli

contracts = importlib.import_module("03_contracts")
engine04 = importlib.import_module("04_engine")
SamplingParams = contracts.SamplingParams


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

    def mask(self, logits: torch.Tensor) -> None:
        """-inf for every token that would leave the language: a scan of the whole vocabulary."""
        keep = torch.tensor([self.allowed(t) for t in range(logits.shape[-1])]) if not self.finished else \
            torch.zeros(logits.shape[-1], dtype=torch.bool)
        logits.masked_fill_(~keep, float("-inf"))

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


# --8<-- [start:grammar]
def parse_grammar(spec: tuple):
    """SamplingParams.structured as an xgrammar Grammar: parsed, not yet tied to a tokenizer."""
    import xgrammar as xgr   # the library is only needed when a request asks for structure

    kind, value = spec
    if kind == "json_schema":   # compact separators: whitespace is where small models loop forever
        return xgr.Grammar.from_json_schema(value, any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object", "additionalProperties": true}',
                                            any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    if kind == "choice":   # JSON's string escapes are EBNF's too
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "structural_tag":   # free text with tagged, schema-checked parts (tool calls)
        return xgr.Grammar.from_structural_tag(json.dumps(compact_json(json.loads(value))))
    raise ValueError(f"structured: unknown kind {kind!r}")


def compact_json(tag):
    """A structural tag whose JSON parts are compact too: each json_schema part becomes the
    grammar of its schema, written without free whitespace."""
    import xgrammar as xgr

    if isinstance(tag, list):
        return [compact_json(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema" and "json_schema" in tag:
        schema = json.dumps(tag["json_schema"])
        return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))}
    return {key: compact_json(value) for key, value in tag.items()}


@functools.lru_cache(maxsize=1024)
def check_structured(spec: tuple) -> None:
    """Refuse a constraint that does not parse (03_contracts calls this through kit/plugins.py)."""
    try:
        parse_grammar(spec)
    except Exception as exc:   # xgrammar reports every problem as a RuntimeError with its C++ location
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", "", str(exc).strip())
        raise ValueError(f"structured {spec[0]} does not compile: {message.splitlines()[0]}") from None


@functools.lru_cache(maxsize=8)
def compiler_for(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """One GrammarCompiler per tokenizer: it knows every token's bytes, read once."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    return xgr.GrammarCompiler(info, max_threads=2)


@functools.lru_cache(maxsize=256)
def compile_spec(tokenizer, vocab_size: int, stop_ids: tuple[int, ...], spec: tuple):
    """The grammar compiled against the vocabulary, once per (tokenizer, constraint)."""
    return compiler_for(tokenizer, vocab_size, stop_ids).compile_grammar(parse_grammar(spec))
# --8<-- [end:grammar]


# --8<-- [start:constraint]
BITS = torch.arange(32, dtype=torch.int32)


class GrammarConstraint:
    """One request's place in its grammar: which tokens may come next, and what came so far.

    The interface the engines use (07_decode_loop.py): `mask` a row of logits before sampling,
    `accept` the sampled token, `finished` once the grammar ended (its EOS accepted).
    Speculative decoding adds `allowed` (may a draft token come next?) and `rollback`.
    """

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)   # rollback of any depth
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)   # 1 bit a token, in int32 words

    def allowed_mask(self) -> torch.Tensor:
        """[vocab] bools: bit j of word w says whether token 32*w + j may come next."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return ((self.bitmask[0].unsqueeze(-1) >> BITS) & 1).bool().view(-1)[: self.vocab_size]

    def mask(self, logits: torch.Tensor) -> None:
        """In place, on one row: -inf for every token the grammar forbids next."""
        logits.masked_fill_(~self.allowed_mask().to(logits.device), float("-inf"))

    def allowed(self, token: int) -> bool:
        return bool(self.allowed_mask()[token])

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()


def make_constraint(tokenizer, vocab_size: int, eos_ids, spec: tuple) -> GrammarConstraint:
    """What an OutputProcessor calls (kit/plugins.py's "structured_output") for a new request."""
    return GrammarConstraint(compile_spec(tokenizer, vocab_size, tuple(sorted(eos_ids)), spec), vocab_size)
# --8<-- [end:constraint]


# --8<-- [start:hf]
class ConstraintProcessor(LogitsProcessor):
    """The same constraint inside HF's generate (Chapter 1's engine): HF calls this before each
    token with the ids so far, so the previous call's token is accepted first. HF stops at the
    grammar's EOS itself (SamplingParams.stops_on_eos)."""

    def __init__(self, constraint):
        self.constraint, self.n_seen = constraint, None

    def __call__(self, input_ids, scores):
        if self.n_seen is not None and input_ids.shape[1] > self.n_seen:
            self.constraint.accept(int(input_ids[0, -1]))
        self.n_seen = input_ids.shape[1]
        scores = scores.clone()
        self.constraint.mask(scores[0])
        return scores


def hf_processor(tokenizer, vocab_size: int, eos_ids, spec: tuple) -> ConstraintProcessor:
    return ConstraintProcessor(make_constraint(tokenizer, vocab_size, eos_ids, spec))
# --8<-- [end:hf]


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
    engine = engine10.ModelEngine(args.model, device=args.device)
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
    prompt = engine04.render_chat(tokenizer, [{"role": "user", "content": question}])
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
    prompt = engine04.render_chat(tokenizer, [{"role": "user", "content": question}])
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
