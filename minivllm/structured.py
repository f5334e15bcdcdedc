"""Chapter 11: output that always parses, by masking tokens at every step.

Before each token is sampled, every token that would take the text outside the language gets
a logit of -inf, so the sampler can only pick tokens that keep the text a valid prefix.
xgrammar (the library vLLM and SGLang use) compiles the vocabulary against the grammar once,
so that a step's mask costs microseconds.

Engines receive the feature as an object, `StructuredOutput()`, passed in by whoever builds
them (`LLM`, `kit/engines.load_engine`): an engine of an earlier chapter never imports this one.
"""

from __future__ import annotations

import functools
import json
import re

import torch
from transformers import LogitsProcessor

from minivllm.json_keys import KeyGuard, quote_tokens
from minivllm.output import unpack_bits

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


# --8<-- [start:schema-keywords]
# A grammar enforces what it can express, and xgrammar skips what it cannot: a schema asking for
# `uniqueItems` or `not` would come back answered by output that ignores them. So a schema may use
# only keywords the grammar enforces (checked against xgrammar's output), plus annotations that
# constrain nothing; anything else is refused by name, as OpenAI's strict mode refuses it.
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
            "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
            "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "deprecated", "readOnly", "writeOnly"}
# The string formats xgrammar turns into rules; any other name compiles to a plain string.
FORMATS = {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
WHY_NOT = {"oneOf": "the grammar cannot check that exactly one branch matches; use anyOf",
           "additionalProperties": "a key the schema does not name could be written twice; "
                                   "name every key and set additionalProperties to false"}


def check_schema(schema, where: str = "schema") -> None:
    """A ValueError naming the first keyword of `schema` the grammar would not enforce, or a
    $ref outside the schema (remote schemas are never fetched)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object (a schema), got {type(schema).__name__}")
    for key, value in schema.items():
        at = f"{where}.{key}"
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED or (key == "additionalProperties" and value is not False):
            reason = WHY_NOT.get(key, "the grammar cannot enforce it")
            raise ValueError(f"{at}: the keyword {key!r} is not supported ({reason})")
        if key == "format" and value not in FORMATS:
            raise ValueError(f"{at}: the format {value!r} is not supported (known: {', '.join(sorted(FORMATS))})")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ValueError(f"{at}: only references inside the schema ('#/...') are supported, got {value!r}")
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{at}.{name}")
        elif key in ("items", "additionalProperties"):
            check_schema(value, at)
        elif key in ("prefixItems", "anyOf") and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}[{i}]")
# --8<-- [end:schema-keywords]


def schemas_in(spec: tuple) -> list:
    """The JSON schemas a constraint holds: its own, or each json_schema part of a structural tag."""
    kind, value = spec
    if kind == "json_schema":
        return [json.loads(value)]
    if kind != "structural_tag":
        return []
    found = []

    def walk(node):
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
            for item in node.values():
                walk(item)

    walk(json.loads(value))
    return found


@functools.lru_cache(maxsize=1024)
def check_structured(spec: tuple) -> None:
    """Refuse a constraint that would not be kept, or does not parse: a ValueError naming the problem."""
    for schema in schemas_in(spec):
        try:
            check_schema(schema)
        except ValueError as exc:
            raise ValueError(f"structured {spec[0]}: {exc}") from None
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
class GrammarConstraint:
    """One request's place in its grammar: which tokens may come next, and what came so far.

    The interface the engines use (07_decode_loop.py): `fill_bitmask` writes this request's row
    of the step's bitmask before sampling, `accept` the sampled token, `finished` once the
    grammar ended (its EOS accepted). Speculative decoding adds `allowed` (may a draft token
    come next?) and `rollback`; `mask` masks one row alone (HF's generate, the demo's timing).
    """

    def __init__(self, compiled, vocab_size: int, guard: KeyGuard | None = None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)   # rollback of any depth
        self.vocab_size, self.guard = vocab_size, guard   # guard: no key twice in an object (JSON only)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)   # 1 bit a token, in int32 words

    def fill_bitmask(self, words: torch.Tensor, row: int) -> None:
        """Row `row` of a CPU int32 bitmask: bit j of word w says whether token 32*w + j may come next."""
        self.matcher.fill_next_token_bitmask(words, row)
        for token in self.guard.banned() if self.guard else ():   # a token that would repeat a key
            word = int(words[row, token >> 5]) & ~(1 << (token & 31))
            words[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word

    def allowed_mask(self) -> torch.Tensor:
        """[vocab] bools, on the CPU."""
        self.fill_bitmask(self.bitmask, 0)
        return unpack_bits(self.bitmask, self.vocab_size)[0]

    def mask(self, logits: torch.Tensor) -> None:
        """In place, on one row: -inf for every token the grammar forbids next."""
        self.fill_bitmask(self.bitmask, 0)
        keep = unpack_bits(self.bitmask.to(logits.device), logits.shape[-1])[0]
        logits.masked_fill_(~keep, float("-inf"))

    def allowed(self, token: int) -> bool:
        return bool(self.allowed_mask()[token])

    def accept(self, token: int) -> bool:
        ok = self.matcher.accept_token(token)
        if ok and self.guard:
            self.guard.accept(token)
        return ok

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)
        if self.guard:
            self.guard.rollback(n)

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()


def make_constraint(tokenizer, vocab_size: int, eos_ids, spec: tuple) -> GrammarConstraint:
    """One new request's constraint, its grammar compiled against the vocabulary (cached); a
    JSON answer's with a guard against repeated keys, which the grammar cannot forbid."""
    stops = tuple(sorted(eos_ids))
    compiled = compile_spec(tokenizer, vocab_size, stops, spec)
    if spec[0] not in ("json_object", "json_schema"):
        return GrammarConstraint(compiled, vocab_size)
    vocab, quoted = token_bytes(tokenizer, vocab_size, stops)
    return GrammarConstraint(compiled, vocab_size, KeyGuard(quoted, lambda t: vocab[t] if t < len(vocab) else b""))


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """Every token's bytes as the grammar reads them, and those holding a quote (the KeyGuard's)."""
    vocab = compile_spec(tokenizer, vocab_size, stop_ids, ("json_object", True)).tokenizer_info.decoded_vocab
    return vocab, quote_tokens(vocab)
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


# --8<-- [start:feature]
class StructuredOutput:
    """The feature an engine is handed: check a constraint, build one per request, or wrap one
    for HF's generate. Stateless; the compiled grammars are cached per tokenizer and spec."""

    name = "structured_output"

    def check(self, spec: tuple) -> None:
        check_structured(spec)

    def constraint(self, tokenizer, vocab_size: int, eos_ids, spec: tuple) -> GrammarConstraint:
        check_structured(spec)
        return make_constraint(tokenizer, vocab_size, eos_ids, spec)

    def hf_processor(self, tokenizer, vocab_size: int, eos_ids, spec: tuple) -> ConstraintProcessor:
        check_structured(spec)
        return hf_processor(tokenizer, vocab_size, eos_ids, spec)
# --8<-- [end:feature]
