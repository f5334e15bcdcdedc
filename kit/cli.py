"""kit/cli.py - argparse types for the scripts' flags: a bad value is refused before any work.

An instructor types these flags live. A negative count, a NaN rate or a plot path in a folder
that does not exist should fail at once, in one line naming the flag, not with a traceback
after the model has loaded and the benchmark has run. Each type below checks one kind of
value; argparse turns its ArgumentTypeError into `error: argument --flag: ...`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def integer(low: int | None = None, high: int | None = None):
    """An int in [low, high] (either end may be open)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: {_range(low, high)}")
        return value
    return parse


def number(low: float | None = None, high: float | None = None, above: float | None = None):
    """A finite float in [low, high], or strictly greater than `above`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if (above is not None and value <= above) or (low is not None and value < low) or \
                (high is not None and value > high):
            bounds = f"greater than {above:g}" if above is not None else _range(low, high)
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: {bounds}")
        return value
    return parse


def output_file(*suffixes: str):
    """A file to write at the end of a run: checked now (not a folder, a known suffix), its folder
    created now, so that a typo does not cost the whole run."""
    def parse(text: str) -> str:
        path = Path(text)
        if not text or path.is_dir() or text.endswith(("/", "\\")):
            raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file name")
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r} should end in one of {', '.join(suffixes)}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot create the folder of {text!r}: {exc.strerror}") from None
        return text
    return parse


def plot_file():
    return output_file(*PLOT_SUFFIXES)


def _range(low, high) -> str:
    if low is not None and high is not None:
        return f"between {low:g} and {high:g}"
    return f"at least {low:g}" if low is not None else f"at most {high:g}"
