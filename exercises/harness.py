"""What the exercises' checks share: a prediction compared with a measurement, a planted bug."""

from __future__ import annotations

import contextlib
import importlib


def given(value, what: str):
    """The reader's value, or a failure that says where to write it."""
    if value is None:
        raise AssertionError(f"{what} is still None: write your answer in answers.py first")
    return value


def within(predicted, measured, rel: float = 0.0, abs_: float = 0.0, what: str = "prediction") -> None:
    """A prediction passes when |predicted - measured| <= max(abs_, rel * |measured|)."""
    predicted = given(predicted, what)
    allowed = max(abs_, rel * abs(measured))
    assert abs(predicted - measured) <= allowed, (
        f"{what}: you predicted {predicted}, the run measured {measured} "
        f"(the tolerance is {allowed:g}); work out why before changing the number")


@contextlib.contextmanager
def patched(target: str, make):
    """Replace the attribute `module.path:Attr.name` by make(original) for the duration: a defect
    planted in the real part, around its own code, never in a copy of it."""
    module_name, _, attr_path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield original
    finally:
        setattr(owner, name, original)


def catches(check, bug, part, what: str = "check") -> None:
    """A find-the-bug check must pass on the real part and raise AssertionError with the bug
    planted. `bug()` plants it (a context manager); `part()` hands the check what it examines."""
    try:
        check(part())
    except NotImplementedError:
        raise AssertionError(f"{what} is not written yet (answers.py)") from None
    except AssertionError as exc:
        raise AssertionError(f"{what} fails on the correct code too: {exc}") from None
    with bug():
        try:
            check(part())
        except AssertionError:
            return
    raise AssertionError(f"{what} passes with the bug planted: it does not catch it")
