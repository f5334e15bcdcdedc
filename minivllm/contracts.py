"""Chapter 1: the types every engine, server and benchmark agrees on.

`BaseOfflineEngine` is the contract: a prompt in, a `GenerateResult` out, one request or a
list. What goes in (`SamplingParams`) and what comes out (`GenerateResult`, with its
`RequestMetrics`) are plain dataclasses with no torch inside: ordinary Python values that a
server turns into JSON and a benchmark adds up. Every size a client controls is bounded here,
once (`REQUEST_FIELDS`, which the server's request models read too), so a bad value is a
ValueError at construction wherever it comes from.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import InitVar, asdict, dataclass, fields
from typing import Literal

from minivllm.request_fields import RequestField, request_field

FinishReason = Literal["stop", "length"]

# Each SamplingParams field's bounds are declared with the field (REQUEST_FIELDS, below); these
# two rules are about single values inside a field, not about the field as a whole.
MIN_TEMPERATURE = 1e-5                 # a sampling temperature; logits / 1e-300 overflow float32: NaN probabilities
LOGIT_BIAS_RANGE = (-100.0, 100.0)     # each logit_bias value (OpenAI's bound)
# Structured output (Chapter 11): one constraint per request, each kind with its own text.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_STRUCTURED_CHARS = 32_768          # a schema's JSON text, a regex or an EBNF grammar
MAX_SCHEMA_DEPTH = 16                  # nesting of a schema's objects and lists
MAX_CHOICES, MAX_CHOICE_CHARS = 64, 256
# Chapter 16: answers to one prompt. OpenAI caps best_of at 20 (and n at 128 on chat completions).
MAX_BEST_OF, MAX_N = 20, 128
# An engine enforces a constraint with a structured-output object it was given when built (Chapter 11).
NO_STRUCTURED_OUTPUT = ("this engine was built without structured output: pass "
                        "structured_output=minivllm.structured.StructuredOutput() (LLM, the server and the "
                        "benchmarks do)")


# --8<-- [start:sampling-params]
@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. The defaults mean greedy decoding.

    Each field is declared once, with its default, its help and its bounds; REQUEST_FIELDS
    (below) is the table of them that these checks and the server's request models both read.
    """

    temperature: float = request_field(0.0, "0 means greedy: always the most likely token",
                                       low=0.0, high=2.0, note="0 is greedy")
    top_p: float = request_field(1.0, "nucleus: keep the smallest set with this much probability",
                                 low=0.0, low_open=True, high=1.0)
    top_k: int = request_field(0, "keep only the k most likely tokens", low=0, note="0 turns it off")
    max_tokens: int | None = request_field(None, "a cap on new tokens, on top of max_new_tokens", low=1,
                                           openai="max_completion_tokens")
    seed: int | None = request_field(None, "same seed, same sampled text", low=-(2**63), high=2**64 - 1,
                                     note="a 64-bit integer")   # what torch.Generator.manual_seed takes
    # OpenAI allows four stop strings and vLLM any number; 64 and the length cap keep the
    # per-token check for "could this tail grow into a stop string?" cheap.
    stop: tuple[str, ...] = request_field((), "generation ends before the first of these strings",
                                          max_items=64, max_chars=256)
    ignore_eos: bool = request_field(False, "keep going past end-of-sequence (benchmarks use it)")
    # Adjustments to the logits before temperature, in the order HF's generate applies them,
    # bounded as OpenAI bounds them. vLLM's repetition_penalty has no bound, but beyond 2 it only
    # garbles text, and below 0.01 a seen token's logit is multiplied past float32's range.
    logit_bias: tuple[tuple[int, float], ...] = request_field(
        (), "OpenAI: (token id, added to its logit) pairs; a dict works too", max_items=300)
    repetition_penalty: float = request_field(
        1.0, "HF/vLLM: a token already seen, prompt included, has its logit divided (positive) or "
             "multiplied (negative) by it", low=0.01, high=2.0, note="1 is off")
    presence_penalty: float = request_field(0.0, "OpenAI: subtracted once from each token already in the output",
                                            low=-2.0, high=2.0)
    frequency_penalty: float = request_field(0.0, "OpenAI: subtracted once per time a token occurs in the output",
                                             low=-2.0, high=2.0)
    logprobs: int | None = request_field(None, "None: off; k: the chosen token's log-probability and the k "
                                               "likeliest", low=0, high=20, openai="top_logprobs")
    # vLLM's: the prefill scores the prompt itself (minivllm/prompt_logprobs.py), the first token None
    prompt_logprobs: int | None = request_field(None, "vLLM's: None: off; k: each prompt token's log-probability "
                                                      "and the k likeliest (the first token: None)", low=0, high=20)
    # Chapter 11: a dict with one key, {"json_schema": dict or JSON text}, {"json_object": True},
    # {"regex": str}, {"grammar": EBNF str} or {"choice": [str, ...]}, kept as the pair (kind, text)
    # (choice: a tuple of str)
    structured: tuple[str, str | tuple[str, ...]] | None = request_field(
        None, "the output must match this constraint; None: free text", openai="response_format")
    # Chapter 8: tenants that must not learn each other's prompts use different salts.
    cache_salt: str | None = request_field(None, "vLLM's: a prefix cache shares a prompt's blocks only "
                                                 "with requests of the same salt", max_chars=256)
    # vLLM's: a floor under the probabilities, held back endings, token ids that end the answer
    min_p: float = request_field(0.0, "vLLM's: drop tokens less likely than min_p times the likeliest one "
                                      "(after temperature)", low=0.0, high=1.0, note="0 turns it off")
    min_tokens: int = request_field(0, "vLLM's: no EOS, stop token or stop string ends the answer before "
                                       "this many new tokens", low=0, high=1 << 20)
    stop_token_ids: tuple[int, ...] = request_field((), "vLLM's: generation ends at any of these token ids "
                                                        "(kept in token_ids, not in the text)", max_items=64)
    # Chapter 16: several answers to one prompt, sharing its KV blocks
    n: int = request_field(1, "answers to return for the prompt, each its own sequence on the prompt's shared blocks",
                           low=1, high=MAX_N)
    best_of: int | None = request_field(None, "OpenAI's: generate this many answers, return the n with the "
                                              "highest mean log-probability per token", low=1, high=MAX_BEST_OF)
    # vLLM's structured-output spellings, read into `structured` (not fields of their own)
    structured_outputs: InitVar[object] = None
    guided_decoding: InitVar[object] = None

    def __post_init__(self, structured_outputs=None, guided_decoding=None) -> None:
        for name, given in (("structured_outputs", structured_outputs), ("guided_decoding", guided_decoding)):
            if given is not None:     # vLLM's StructuredOutputsParams / GuidedDecodingParams: one constraint
                if not isinstance(given, StructuredOutputsParams):
                    raise ValueError(f"{name} must be a StructuredOutputsParams, got {type(given).__name__}")
                if self.structured is not None:
                    raise ValueError(f"{name} and structured both ask for a constraint; give one")
                object.__setattr__(self, "structured", given.constraint())
        if isinstance(self.stop, str):  # a lone string is one stop sequence, not its letters
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                is_integer(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r:.80}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_types()
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, float(v)) for k, v in bias)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from exc
        for spec in REQUEST_FIELDS.values():   # every field's bounds, from the one table
            spec.check(getattr(self, spec.name))
        if self.temperature != 0 and self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}")
        self._check_logit_bias()
        if self.structured is not None:
            object.__setattr__(self, "structured", structured_spec(self.structured))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.min_tokens and self.structured is not None:
            raise ValueError("min_tokens does not combine with structured output: the grammar decides where the "
                             "answer may end")

    def _check_types(self) -> None:
        # True is an int in Python, "0.5" would fail later, deep in torch, with a TypeError,
        # and NaN slips past every range comparison.
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "seed", "logprobs", "prompt_logprobs", "min_tokens", "n", "best_of"):
            value = getattr(self, name)
            if (value is not None or name in ("top_k", "min_tokens", "n")) and not is_integer(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {self.cache_salt!r:.80}")

    @classmethod
    def or_default(cls, params: SamplingParams | None) -> SamplingParams:
        """What an engine was given as params: None means the defaults (greedy); anything else is an error."""
        if params is None:
            return cls()
        if not isinstance(params, cls):
            raise ValueError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        return params

    def _check_logit_bias(self) -> None:
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not (math.isfinite(bias) and LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]):
                raise ValueError(f"logit_bias values must be between {LOGIT_BIAS_RANGE[0]:g} and "
                                 f"{LOGIT_BIAS_RANGE[1]:g}, got {bias} for token {token_id}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token more than once")

    @property
    def adjusts_logits(self) -> bool:
        """True when a bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or \
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in logit_bias and stop_token_ids must exist in the model's vocabulary (the engine knows its size)."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} names token {bad[0]}, but the vocabulary has {vocab_size} tokens "
                                 f"(ids 0 to {vocab_size - 1})")

    @property
    def stops_on_eos(self) -> bool:
        """EOS ends the request, unless ignore_eos; a grammar's EOS always does (Chapter 11)."""
        return not self.ignore_eos or self.structured is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs (Chapter 16): best_of of them, or n; each holds a seat of the batch."""
        return self.best_of or self.n

    def token_budget(self, max_new_tokens: int) -> int:
        """The number of new tokens a request may produce: max_new_tokens, capped by max_tokens."""
        check_max_new_tokens(max_new_tokens)
        return min(max_new_tokens, self.max_tokens or max_new_tokens)


# The table of request fields: SamplingParams' fields, in order, each with its help and bounds.
REQUEST_FIELDS = {f.name: RequestField(f.name, f.type, f.default, **f.metadata) for f in fields(SamplingParams)}
# Bounds that scripts and tests name (02_sampling's --seed, 03_contracts' demonstrations).
SEED_RANGE = (REQUEST_FIELDS["seed"].low, REQUEST_FIELDS["seed"].high)
REPETITION_RANGE = (REQUEST_FIELDS["repetition_penalty"].low, REQUEST_FIELDS["repetition_penalty"].high)
MAX_STOP_STRINGS, MAX_STOP_CHARS = REQUEST_FIELDS["stop"].max_items, REQUEST_FIELDS["stop"].max_chars


def check_prompts(prompts) -> None:
    """generate_batch's prompts: a list (or tuple) of prompts, not one string."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a list of strings")


def is_integer(value) -> bool:
    """An int that is not a bool (True is an int in Python, but not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_max_new_tokens(max_new_tokens) -> None:
    """An integer >= 1: NaN, 1.5 or True would slip past the comparisons that bound a request."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
# --8<-- [end:sampling-params]



# --8<-- [start:structured]
@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's spelling of one constraint (`SamplingParams(structured_outputs=StructuredOutputsParams(
    json=schema))`; its older name, GuidedDecodingParams, is the same class): exactly one field set.
    It becomes SamplingParams.structured, the engine's own (kind, text) pair."""

    json: dict | str | None = None           # a JSON Schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None               # EBNF (xgrammar's dialect, as vLLM's default backend)
    json_object: bool | None = None
    structural_tag: dict | str | None = None

    def constraint(self) -> tuple[str, str | tuple[str, ...]]:
        kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                 "json_object": "json_object", "structural_tag": "structural_tag"}
        given = {name: value for name in kinds if (value := getattr(self, name)) not in (None, False)}
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(kinds)}, got {sorted(given) or 'none'}")
        (name, value), = given.items()
        return structured_spec({kinds[name]: value})


GuidedDecodingParams = StructuredOutputsParams   # vLLM's name for it before version 0.11


def structured_spec(structured) -> tuple[str, str | tuple[str, ...]]:
    """A structured-output request as a hashable (kind, text) pair, bounded and checked to compile.

    Compiling against a tokenizer happens in the engine (Chapter 11, 15_structured_output.py);
    here the grammar is only parsed, so that a bad one is refused before any request runs.
    """
    if isinstance(structured, dict):
        if len(structured) != 1 or next(iter(structured)) not in STRUCTURED_KINDS:
            raise ValueError(f"structured takes exactly one of {', '.join(STRUCTURED_KINDS)}, got {sorted(structured)}")
        structured = next(iter(structured.items()))
    if not (isinstance(structured, tuple) and len(structured) == 2 and structured[0] in STRUCTURED_KINDS):
        raise ValueError(f"structured must be a dict such as {{'json_schema': {{...}}}}, got {structured!r}")
    kind, value = structured
    if kind == "json_object":
        if value not in (True, ""):
            raise ValueError(f"structured json_object must be True, got {value!r}")
        value = ""
    elif kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError("structured choice must be a non-empty list of strings")
        if len(value) > MAX_CHOICES or any(not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS for c in value):
            raise ValueError(f"structured choice takes 1 to {MAX_CHOICES} non-empty strings of at most "
                             f"{MAX_CHOICE_CHARS} characters")
        value = tuple(value)
    else:
        if kind in ("json_schema", "structural_tag"):
            value = schema_text(value, f"structured {kind}")
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured {kind} must be a non-empty string, got {value!r}")
        if len(value) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"structured {kind} may be at most {MAX_STRUCTURED_CHARS} characters, got {len(value)}")
    # Whether the text parses as its kind is the grammar library's call: the engine's structured
    # output (Chapter 11) compiles it when the request is admitted, and a server asks it on arrival.
    return kind, value


def schema_text(schema, name: str = "schema") -> str:
    """A JSON Schema (a dict or its JSON text) as compact JSON text, its size and depth bounded."""
    if isinstance(schema, str):
        if len(schema) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"{name} may be at most {MAX_STRUCTURED_CHARS} characters, got {len(schema)}")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(schema).__name__}")
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{name} is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)   # key order kept: it is the output's
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not JSON: {exc}") from None
    if len(text) > MAX_STRUCTURED_CHARS:
        raise ValueError(f"{name} may be at most {MAX_STRUCTURED_CHARS} characters, got {len(text)}")
    return text


def json_depth(value, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """How deep dicts and lists nest (stops counting past limit, so a hostile value costs little)."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((json_depth(v, limit - 1) for v in children), default=0)
# --8<-- [end:structured]


# --8<-- [start:metrics]
@dataclass
class RequestMetrics:
    """What one request cost. TTFT and TPOT only exist for engines that can see the loop."""

    throughput: float               # output tokens per second of wall time
    input_tokens: int               # prompt length in tokens
    output_tokens: int              # tokens generated (== len(GenerateResult.output_ids))
    ttft_ms: float | None = None    # time to first token: prefill plus the first sample
    tpot_ms: float | None = None    # time per output token after the first: the decode pace
    queue_ms: float | None = None   # arrival -> first scheduled (engines with a scheduler, Chapter 9)
    cached_tokens: int | None = None  # prompt tokens whose K/V a prefix cache served (Chapter 8)
    draft_tokens: int | None = None     # guessed tokens verified (speculative decoding, Chapter 10)
    accepted_tokens: int | None = None  # ... of which the model kept this many

    def as_dict(self) -> dict:
        """A JSON-ready dict that leaves out what was not measured (no misleading nulls)."""
        return {k: v for k, v in asdict(self).items() if v is not None}
# --8<-- [end:metrics]


# --8<-- [start:logprobs]
@dataclass(frozen=True)
class TokenLogprob:
    """How likely the model found one generated token, and its likeliest alternatives.

    Log-probabilities of the model's own distribution: before bias, penalties and temperature
    (vLLM's default, "raw logprobs"), so they describe the model, not the sampling settings.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, log-probability), most likely first


class TextPiece(str):
    """A streamed text piece that also carries the log-probabilities of the tokens it completes.

    It is a str, so every consumer of a stream that does not care keeps working unchanged.
    """

    logprobs: tuple[TokenLogprob, ...]
    index: int   # which answer it belongs to (Chapter 16: a request for n answers streams them all)

    def __new__(cls, text: str, logprobs=(), index: int = 0):
        piece = super().__new__(cls, text)
        piece.logprobs, piece.index = tuple(logprobs), index
        return piece


def join_pieces(pieces: list[str]) -> str:
    """Several tokens' pieces as one, keeping the log-probabilities they carry."""
    logprobs = [lp for p in pieces for lp in getattr(p, "logprobs", ())]
    return TextPiece("".join(pieces), logprobs) if logprobs else "".join(pieces)


def piece_index(piece: str) -> int:
    """The answer a streamed piece belongs to: 0 unless a request asked for several (Chapter 16)."""
    return piece.index if isinstance(piece, TextPiece) else 0   # (a plain str's .index is a method)
# --8<-- [end:logprobs]


# --8<-- [start:result]
@dataclass
class CompletionOutput:
    """One answer to a prompt, in vLLM's names (a request asking for n answers has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    cumulative_logprob: float | None = None     # the sum of logprobs' (None: logprobs not asked for)
    logprobs: list[TokenLogprob] | None = None  # one per token id (vLLM: one dict of alternatives per token)
    stop_reason: str | int | None = None        # the stop string or stop token id that ended it (None: EOS, length)

    @property
    def output_ids(self) -> list[int]:
        """The book's name for token_ids (GenerateResult's)."""
        return self.token_ids


@dataclass
class GenerateResult:
    """One finished request: the new text, its token ids, what it cost, and why it ended.

    It also reads as vLLM's RequestOutput: `prompt`, `prompt_token_ids`, `prompt_logprobs` and
    `outputs`, a list of CompletionOutput. For one answer per prompt, `outputs[0]` is this
    result's own text, ids, finish_reason and logprobs; an engine that makes several answers
    passes them all as `outputs`, and the fields above read as the first."""

    text: str
    output_ids: list[int]
    metrics: RequestMetrics
    finish_reason: FinishReason = "length"  # "stop": EOS or a stop string; "length": the budget ran out
    logprobs: list[TokenLogprob] | None = None   # one per output id, when SamplingParams.logprobs asked
    prompt: str | None = None                    # the prompt's text, when it came as text
    prompt_token_ids: list[int] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    outputs: list[CompletionOutput] | None = None   # None: made from the fields above (one answer)
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
        if self.outputs is None:
            cumulative = None if self.logprobs is None else sum(e.logprob for e in self.logprobs)
            self.outputs = [CompletionOutput(0, self.text, self.output_ids, self.finish_reason, cumulative,
                                             self.logprobs, self.stop_reason)]
        if not self.outputs:
            raise ValueError("a GenerateResult has at least one output")
# --8<-- [end:result]


# --8<-- [start:capabilities]
@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine is and can do beyond the contract, stated once, by the engine itself
    (`BaseOfflineEngine.capabilities()`). The server and the benchmarks read this record and
    nothing else about an engine: each chapter's engine is served and measured for what it says
    it does. The defaults are the contract alone, generate and generate_batch."""

    model_name: str | None = None       # the model it serves (None: the server shows the class's name)
    device: str | None = None           # where it runs, for a benchmark's record
    context_length: int | None = None   # prompt and answer tokens together, at most (None: unknown)
    streams: bool = False               # generate_stream yields text pieces as they are made
    # A prompt may be its token ids: a server then tokenises a chat once, each message's text read
    # as text, and hands the ids on (a client typing "<|im_start|>" forges no turn). An engine that
    # takes only text gets the rendered template.
    accepts_token_ids: bool = False
    checks_prompts: bool = False        # encode(prompt, max_new_tokens) refuses a prompt before any work
    max_batch_size: int | None = None   # generate_batch runs this many prompts together (Chapter 5)
    # An engine loop (Chapter 9): new_request checks a prompt and builds its Request, submit_all hands
    # requests over in one go, stats() counts those "running" and "waiting"; a server gives it
    # requests at once.
    schedules_itself: bool = False
    max_num_seqs: int | None = None     # sequences in one step: the seats of an engine that schedules itself
    token_capacity: int | None = None   # the most tokens one request can ever hold: its KV pool (None: no pool)
    # Chapter 17: LoRA adapters served by name (add_lora, list_loras); new_request takes a lora_request.
    serves_adapters: bool = False
    vllm_sampling: bool = False         # it honours SamplingParams' min_p, min_tokens and stop_token_ids
    scores_prompts: bool = False        # it honours SamplingParams.prompt_logprobs (minivllm/prompt_logprobs.py)
    parallel_sampling: bool = False     # Chapter 16: SamplingParams' n and best_of, several answers per prompt

    def __post_init__(self) -> None:
        for name in ("context_length", "max_batch_size", "max_num_seqs", "token_capacity"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    def replace(self, **changes) -> EngineCapabilities:
        """This record with some fields changed: a subclass states what it adds to its parent's."""
        return type(self)(**{**vars(self), **changes})
# --8<-- [end:capabilities]


# --8<-- [start:interface]
class BaseOfflineEngine(ABC):
    """Text in, GenerateResult out. Every chapter's engine is one of these."""

    @abstractmethod
    def generate(
        self,
        prompt: str,
        max_new_tokens: int,
        params: SamplingParams | None = None,
    ) -> GenerateResult: ...

    @abstractmethod
    def generate_batch(
        self,
        prompts: list[str],
        max_new_tokens: int,
        params: SamplingParams | None = None,
    ) -> list[GenerateResult]: ...

    # What a server and a benchmark ask every engine besides, answered here for an engine that
    # has nothing more to say: a later chapter's engine overrides what it can answer.
    def capabilities(self) -> EngineCapabilities:
        """What this engine is and can do beyond generate and generate_batch."""
        return EngineCapabilities()

    def features(self) -> dict:
        """What it was built with (a weight format, prefix caching...), for the server's page and /metrics."""
        return {}

    def stats(self) -> dict:
        """The counters it keeps (KV blocks, its queue), for the server's page and /metrics."""
        return {}

    def snapshot(self) -> dict | None:
        """Its scheduler's state, for the classroom page (Chapter 9); an engine without one says so."""
        return {"available": False, "engine": type(self).__name__}

    def unavailable(self) -> str | None:
        """Why it can serve nothing more (Chapter 14: a tensor-parallel worker died), or None."""
        return None

    def close(self) -> None:
        """Let go of what it holds beyond memory: a loop thread, worker processes. Nothing, here."""
# --8<-- [end:interface]
