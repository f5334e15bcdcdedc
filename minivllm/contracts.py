"""Chapter 1: the types every engine, server and benchmark agrees on.

`BaseOfflineEngine` is the contract: a prompt in, a `GenerateResult` out, one request or a
list. What goes in (`SamplingParams`) and what comes out (`GenerateResult`, with its
`RequestMetrics`) are plain dataclasses with no torch inside: ordinary Python values that a
server turns into JSON and a benchmark adds up. Every size a client controls is bounded here,
once, so a bad value is a ValueError at construction wherever it comes from.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]

# Every size a client controls is capped. Four stop strings is OpenAI's limit; the length
# cap keeps the per-token check for "could this tail grow into a stop string?" cheap.
MAX_STOP_STRINGS = 4
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.Generator.manual_seed accepts
# OpenAI's bounds for the logit adjustments and log-probabilities; vLLM's repetition_penalty
# has none, but beyond 2 it only garbles text, and 0 or less would flip or divide by zero.
PENALTY_RANGE = (-2.0, 2.0)            # presence_penalty, frequency_penalty
REPETITION_RANGE = (0.01, 2.0)         # repetition_penalty; 1 is off. Below 0.01 a seen token's logit
                                       # is multiplied past float32's range: inf, then NaN probabilities
MIN_TEMPERATURE = 1e-5                 # a sampling temperature; logits / 1e-300 overflow float32 the same way
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 300                   # entries in one logit_bias
MAX_TOP_LOGPROBS = 20
# Structured output (Chapter 11): one constraint per request, each kind with its own text.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_STRUCTURED_CHARS = 32_768          # a schema's JSON text, a regex or an EBNF grammar
MAX_SCHEMA_DEPTH = 16                  # nesting of a schema's objects and lists
MAX_CHOICES, MAX_CHOICE_CHARS = 64, 256
# An engine enforces a constraint with a structured-output object it was given when built (Chapter 11).
NO_STRUCTURED_OUTPUT = ("this engine was built without structured output: pass "
                        "structured_output=minivllm.structured.StructuredOutput() (LLM, the server and the "
                        "benchmarks do)")


# --8<-- [start:sampling-params]
@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. The defaults mean greedy decoding."""

    temperature: float = 0.0        # 0 means greedy: always the most likely token
    top_p: float = 1.0              # nucleus: keep the smallest set with this much probability
    top_k: int = 0                  # keep only the k most likely tokens; 0 turns it off
    max_tokens: int | None = None   # optional cap on new tokens, on top of max_new_tokens
    seed: int | None = None         # same seed, same sampled text
    stop: tuple[str, ...] = ()      # generation ends before the first of these strings
    ignore_eos: bool = False        # keep going past end-of-sequence (benchmarks use it)
    # Adjustments to the logits before temperature, in the order HF's generate applies them:
    logit_bias: tuple[tuple[int, float], ...] = ()   # OpenAI: (token id, added to its logit); a dict works too
    repetition_penalty: float = 1.0  # HF/vLLM: any token already seen, prompt included, is divided
                                     # (positive logit) or multiplied (negative) by it; 1 is off
    presence_penalty: float = 0.0   # OpenAI: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per time a token occurs in the output
    logprobs: int | None = None     # None: off; k: the chosen token's log-probability and the k likeliest
    # Chapter 11: the output must match this. A dict with one key, {"json_schema": dict or JSON text},
    # {"json_object": True}, {"regex": str}, {"grammar": EBNF str} or {"choice": [str, ...]},
    # kept as the pair (kind, text) (choice: a tuple of str); None: free text
    structured: tuple[str, str | tuple[str, ...]] | None = None
    # Chapter 8: a prefix cache shares a prompt's blocks only with requests of the same salt
    # (vLLM's cache_salt): tenants that must not learn each other's prompts use different ones.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is one stop sequence, not its letters
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        self._check_types()
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, float(v)) for k, v in bias)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from exc
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer (between -2**63 and 2**64 - 1), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters each, "
                             f"got one of {max(len(s) for s in self.stop)}")
        self._check_adjustments()
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, "
                             f"got {self.cache_salt!r:.80}")
        if self.structured is not None:
            object.__setattr__(self, "structured", structured_spec(self.structured))

    def _check_types(self) -> None:
        # True is an int in Python, "0.5" would fail later, deep in torch, with a TypeError,
        # and NaN slips past every range comparison below.
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "seed", "logprobs"):
            value = getattr(self, name)
            if (value is not None or name == "top_k") and not is_integer(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @classmethod
    def or_default(cls, params: SamplingParams | None) -> SamplingParams:
        """What an engine was given as params: None means the defaults (greedy); anything else is an error."""
        if params is None:
            return cls()
        if not isinstance(params, cls):
            raise ValueError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        return params

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be between {PENALTY_RANGE[0]:g} and {PENALTY_RANGE[1]:g}, "
                                 f"got {getattr(self, name)}")
        if not REPETITION_RANGE[0] <= self.repetition_penalty <= REPETITION_RANGE[1]:
            raise ValueError(f"repetition_penalty must be between {REPETITION_RANGE[0]:g} and {REPETITION_RANGE[1]:g} "
                             f"(1 is off), got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not (math.isfinite(bias) and LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]):
                raise ValueError(f"logit_bias values must be between {LOGIT_BIAS_RANGE[0]:g} and "
                                 f"{LOGIT_BIAS_RANGE[1]:g}, got {bias} for token {token_id}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token more than once")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs (the number of alternatives) must be between 0 and "
                             f"{MAX_TOP_LOGPROBS}, got {self.logprobs}")

    @property
    def adjusts_logits(self) -> bool:
        """True when a bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or \
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in logit_bias must exist in the model's vocabulary (the engine knows its size)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token {bad[0]}, but the vocabulary has {vocab_size} tokens "
                             f"(ids 0 to {vocab_size - 1})")

    @property
    def stops_on_eos(self) -> bool:
        """EOS ends the request, unless ignore_eos; a grammar's EOS always does (Chapter 11)."""
        return not self.ignore_eos or self.structured is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def token_budget(self, max_new_tokens: int) -> int:
        """The number of new tokens a request may produce: max_new_tokens, capped by max_tokens."""
        check_max_new_tokens(max_new_tokens)
        return min(max_new_tokens, self.max_tokens or max_new_tokens)


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

    def __new__(cls, text: str, logprobs=()):
        piece = super().__new__(cls, text)
        piece.logprobs = tuple(logprobs)
        return piece


def join_pieces(pieces: list[str]) -> str:
    """Several tokens' pieces as one, keeping the log-probabilities they carry."""
    logprobs = [lp for p in pieces for lp in getattr(p, "logprobs", ())]
    return TextPiece("".join(pieces), logprobs) if logprobs else "".join(pieces)
# --8<-- [end:logprobs]


# --8<-- [start:result]
@dataclass
class GenerateResult:
    """One finished request: the new text, its token ids, what it cost, and why it ended."""

    text: str
    output_ids: list[int]
    metrics: RequestMetrics
    finish_reason: FinishReason = "length"  # "stop": EOS or a stop string; "length": the budget ran out
    logprobs: list[TokenLogprob] | None = None   # one per output id, when SamplingParams.logprobs asked

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
# --8<-- [end:result]


# --8<-- [start:interface]
class BaseOfflineEngine(ABC):
    """Text in, GenerateResult out. Every chapter's engine is one of these."""

    # An engine that also takes a prompt as token ids says so: a server then tokenises a chat once,
    # each message's text read as text, and hands the ids on (a client typing "<|im_start|>"
    # forges no turn). One that takes only text gets the rendered template.
    accepts_token_ids: bool = False

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
# --8<-- [end:interface]
