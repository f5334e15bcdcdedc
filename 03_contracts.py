"""03_contracts.py - the types every engine, server and benchmark agrees on.

Three plain dataclasses, and deliberately no torch import: whatever an engine does
inside, what goes in (`SamplingParams`) and what comes out (`GenerateResult`, with
its `RequestMetrics`) are ordinary Python values that a server can turn into JSON
and a benchmark can add up.

    python 03_contracts.py     # shows the defaults and what bad values do
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]

# Every size a client controls is capped. Four stop strings is OpenAI's limit; the length
# cap keeps the per-token check for "could this tail grow into a stop string?" cheap.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.Generator.manual_seed accepts


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is one stop sequence, not its letters
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("temperature", "top_p"):   # NaN slips past every comparison below
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
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
            raise ValueError(f"each stop string may be at most {MAX_STOP_CHARS} characters, "
                             f"got one of {max(len(s) for s in self.stop)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def token_budget(self, max_new_tokens: int) -> int:
        """The number of new tokens a request may produce: max_new_tokens, capped by max_tokens."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return min(max_new_tokens, self.max_tokens or max_new_tokens)
# --8<-- [end:sampling-params]


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

    def as_dict(self) -> dict:
        """A JSON-ready dict that leaves out what was not measured (no misleading nulls)."""
        return {k: v for k, v in asdict(self).items() if v is not None}
# --8<-- [end:metrics]


# --8<-- [start:result]
@dataclass
class GenerateResult:
    """One finished request: the new text, its token ids, what it cost, and why it ended."""

    text: str
    output_ids: list[int]
    metrics: RequestMetrics
    finish_reason: FinishReason = "length"  # "stop": EOS or a stop string; "length": the budget ran out

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
# --8<-- [end:result]


def main() -> None:
    import argparse

    argparse.ArgumentParser(description="Show SamplingParams' defaults and what bad values do.").parse_args()
    print("[SamplingParams()]")
    params = SamplingParams()
    print(f"  {params}\n  is_greedy = {params.is_greedy}")
    print("\n[SamplingParams(temperature=0.8, top_p=0.95, seed=7)]")
    print(f"  is_greedy = {SamplingParams(temperature=0.8, top_p=0.95, seed=7).is_greedy}")
    print("\n[bad values are refused at construction]")
    for bad in ({"temperature": -1.0}, {"temperature": float("inf")}, {"top_p": 0.0}, {"top_p": 1.5},
                {"top_k": -3}, {"max_tokens": 0}, {"seed": 2**70}):
        try:
            SamplingParams(**bad)
        except ValueError as exc:
            print(f"  SamplingParams(**{bad}) -> ValueError: {exc}")
    print("\n[RequestMetrics.as_dict() leaves out what was not measured]")
    print(f"  baseline-style: {RequestMetrics(throughput=30.2, input_tokens=12, output_tokens=40).as_dict()}")
    print(f"  loop-style:     {RequestMetrics(30.2, 12, 40, ttft_ms=45.0, tpot_ms=32.1).as_dict()}")
    result = GenerateResult(text=" Paris.", output_ids=[7042, 30, 2],
                            metrics=RequestMetrics(25.0, 5, 3), finish_reason="stop")
    print(f"\n[GenerateResult]\n  {result}")


if __name__ == "__main__":
    main()
