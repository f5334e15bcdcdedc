"""kit/progress.py - say how far a long run has got, on a terminal and in a log alike.

A measurement that runs for minutes must not look like a hung process. On a terminal a tqdm
bar redraws one line in place; redirected to a file, that same bar would either vanish (tqdm
switches itself off there) or leave a log full of carriage returns. So when stdout is not a
terminal, every step is its own plain line instead: `[what] 3/32 requests, 41 s, about 380 s
left`. Both go to stderr, so stdout stays the result (and what scripts/capture_outputs.py
keeps for the book) while `python X.py > log 2>&1` still shows the run moving.
"""

from __future__ import annotations

import sys
import threading
import time


def duration(seconds: float) -> str:
    """A human length of time: '45 s', '3.2 min', '1.5 h'."""
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {seconds}")
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def on_terminal() -> bool:
    """Draw a bar only where a person watches: stdout and stderr both a terminal."""
    return sys.stdout.isatty() and sys.stderr.isatty()


class Progress:
    """Counts `total` units (requests, rounds, engines) of a run called `what`.

        with Progress(32, "requests", what="benchmark") as bar:
            for ...: bar.update(1, note="BaselineEngine")
    """

    def __init__(self, total: int, unit: str, what: str = "progress", *, enabled: bool = True,
                 stream=None, clock=time.perf_counter):
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total, self.unit, self.what, self.done = total, unit, what, 0
        self.enabled, self.stream, self.clock = enabled, stream, clock
        self.note = ""                  # said on every line until changed: e.g. the engine being run
        self.lock = threading.Lock()    # reader threads of a batch report as their requests finish
        self.start = clock()
        self.bar = None
        if enabled and stream is None and on_terminal():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{what}: {unit}", file=sys.stderr)

    def line(self, note: str = "") -> str:
        """The plain line for the current count; the estimate assumes the remaining units take
        as long on average as the finished ones did."""
        elapsed = self.clock() - self.start
        text = f"[{self.what}] {self.done}/{self.total} {self.unit}, {duration(elapsed)}"
        if 0 < self.done < self.total:
            text += f", about {duration(elapsed / self.done * (self.total - self.done))} left"
        return text + (f" ({note})" if note else "")

    def update(self, n: int = 1, note: str | None = None) -> None:
        with self.lock:
            self.done += n
            if not self.enabled:
                return
            if self.bar is not None:
                self.bar.update(n)
                return
            print(self.line(self.note if note is None else note), file=self.stream or sys.stderr, flush=True)

    def print(self, text: str) -> None:
        """A result line on stdout while the bar runs: tqdm lifts its bar off the line first and
        draws it again below, so no row is printed over the bar."""
        with self.lock:
            if self.bar is not None:
                self.bar.write(text, file=sys.stdout)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def estimate_s(warm_s: float, warm_tokens: int, budget_tokens: int) -> float | None:
    """Seconds for budget_tokens output tokens at the warm-up's pace per token, were every request
    served alone and to its whole budget: an upper bound for engines that batch or stop early."""
    if warm_tokens <= 0:
        return None
    return warm_s / warm_tokens * budget_tokens


def say(text: str) -> None:
    """A progress remark (a plan, an estimate): on stderr, beside the progress lines."""
    print(text, file=sys.stderr, flush=True)
