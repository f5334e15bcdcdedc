"""Chapter 1: a request field, declared once: its help and the values it may take.

`SamplingParams` (minivllm/contracts.py) declares each of its fields with `request_field`, and
its table `REQUEST_FIELDS` holds one `RequestField` per field. `SamplingParams` checks every
value against those bounds, and the server's request models (kit/openai_api.py) build their
pydantic Fields from the same records, so the library and the server cannot disagree about
what a request may say.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def request_field(default, help: str, **bounds):
    """A dataclass field that carries its help and its bounds (RequestField's names) beside its default."""
    return field(default=default, metadata={"help": help, **bounds})


# --8<-- [start:request-field]
@dataclass(frozen=True)
class RequestField:
    """One field of a request: its name, type, default and meaning, and the values it may take."""

    name: str
    type: str                       # as the dataclass annotates it
    default: object
    help: str
    low: float | None = None        # None: no bound on that side
    high: float | None = None
    low_open: bool = False          # True: low itself is refused (a top_p of 0 keeps no token)
    high_open: bool = False
    max_items: int | None = None    # a list's entries
    max_chars: int | None = None    # a string's characters (each string's, for a list); never 0
    note: str = ""                  # said beside the bounds when a value is refused
    openai: str | None = None       # OpenAI's name for the field, where it differs

    def bounds(self) -> str:
        """The values allowed, in words: 'between -2 and 2', 'in (0, 1]', '>= 1'."""
        low, high = (f"{x:g}" if isinstance(x, float) else str(x) for x in (self.low, self.high))
        if self.low is not None and self.high is not None:
            if not (self.low_open or self.high_open):
                return f"between {low} and {high}"
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"{'<' if self.high_open else '<='} {high}"

    def refusal(self, value, name: str | None = None) -> str:
        """Why value is refused, under the field's name or the one a request used (top_logprobs)."""
        return f"{name or self.name} must be {self.bounds()}{f' ({self.note})' if self.note else ''}, got {value}"

    def check(self, value) -> None:
        """A ValueError naming the field if value, already of the right type, is out of bounds (None: unset)."""
        if value is None:
            return
        if (self.low is not None and (value <= self.low if self.low_open else value < self.low)) or \
                (self.high is not None and (value >= self.high if self.high_open else value > self.high)):
            raise ValueError(self.refusal(value))
        if self.max_items is not None and len(value) > self.max_items:
            raise ValueError(f"{self.name} takes at most {self.max_items} entries, got {len(value)}")
        texts = (value,) if isinstance(value, str) else value
        bad = next((t for t in texts if not 0 < len(t) <= self.max_chars), None) if self.max_chars else None
        if bad is not None:
            each = "" if isinstance(value, str) else " each"
            raise ValueError(f"{self.name} must be 1 to {self.max_chars} characters{each}, got {len(bad)}")
# --8<-- [end:request-field]
