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

from minivllm.config import EngineConfig, Option, parse_bytes
from minivllm.model_files import DTYPE_NAMES

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


PLOTS_DIR = "plots"   # git-ignored: pictures a reader draws stay out of the repository's status


def plot_file():
    """A picture to write: a bare name (`--plot kv.png`) goes into plots/, so the README's commands
    leave no files in the repository's root; a name with a folder (book/assets/...) is kept as given."""
    check = output_file(*PLOT_SUFFIXES)

    def parse(text: str) -> str:
        check(text)                        # refused in the words the reader typed
        return check(str(Path(PLOTS_DIR) / text)) if Path(text).name == text else text
    return parse


def _range(low, high) -> str:
    if low is not None and high is not None:
        return f"between {low:g} and {high:g}"
    return f"at least {low:g}" if low is not None else f"at most {high:g}"


class _TorchThreads(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        import torch   # only when the flag is given: the rest of this module needs no torch

        torch.set_num_threads(value)
        setattr(namespace, self.dest, value)


def add_model_flags(parser: argparse.ArgumentParser, device: bool = True, threads: bool = False) -> None:
    """--model (and --device, --threads): the flags of every script that loads a model.
    --threads N (the options table's row) sets torch's CPU threads as it is parsed. On a 2-core
    machine shared with other work, torch's two threads mostly wait for each other; one is steadier."""
    parser.add_argument("--model", default=None, help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    if device:
        parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    if threads:
        flag, spec = flag_for("threads", *EngineConfig.table()["threads"])
        parser.add_argument(flag, **spec)


def fraction(text: str) -> float:
    """A number in (0, 1], as an argparse type."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def byte_size(text: str) -> int:
    """parse_bytes as an argparse type."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --8<-- [start:engine-options]
# Every feature of the assembled engine is one keyword of its constructor, and the same name
# as a flag of 05_server.py and of both benchmarks (--kv-memory is kv_memory=...). Each flag is
# made from the option's row in minivllm/config.py: its type, bounds, choices and help, written once.
ENGINE_OPTIONS = (*EngineConfig.names(), "dtype")   # dtype: every engine's, from Chapter 1 on
PROCESS_OPTIONS = ("threads",)   # the whole process's: applied as the flag is parsed, for every engine


def flag_for(name: str, default, row: Option) -> tuple[str, dict]:
    """The argparse flag of one option. Its default is None (the flag is then not passed at all,
    so each engine keeps its own); the help says what the assembled engine's default is."""
    if row.kind == "int":
        spec = {"type": integer(row.low, row.high)}
    elif row.kind == "choice":   # group sizes are numbers: typed, so that "32" is the choice 32
        spec = {"choices": row.choices, "type": integer() if isinstance(row.choices[0], int) else checked(name, row)}
    else:
        spec = {"bytes": {"type": byte_size}, "fraction": {"type": fraction}, "text": {},
                "flag": {"action": "store_true"}, "switch": {"action": "store_true"}}[row.kind]
    if name in PROCESS_OPTIONS:   # torch's threads: set now, so that any engine, whatever it takes, runs on them
        spec["action"] = _TorchThreads
    shown = "" if default is None or row.kind in ("flag", "switch") else f"; default {default}"
    return "--" + name.replace("_", "-"), {**spec, "default": None, "help": f"{row.help} (Chapter {row.chapter}{shown})"}


def checked(name: str, row: Option):
    """A choice's text, refused with the row's own reason (quantization=awq says why, not only the choices)."""
    def parse(text: str) -> str:
        try:
            row.check(name, text)
        except ValueError as exc:
            if not str(exc).startswith(f"{name} must be"):   # the plain "not a choice" is argparse's to say
                raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return parse


def add_engine_options(parser: argparse.ArgumentParser, only: tuple[str, ...] = ENGINE_OPTIONS) -> None:
    """The engine's switches as flags. Left out, a flag is not passed at all, so every engine
    keeps its own default, and an engine that lacks the feature is only asked when it is named.
    `only`: the features a script's own engine has (its other flags are not offered)."""
    g = _OnlyGroup(parser.add_argument_group("engine features (the engine's constructor keywords of the same names)"),
                   only)
    g.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="the weights' and activations' precision (default auto: bfloat16 on a GPU, float32 elsewhere)")
    for name, (default, row) in EngineConfig.table().items():
        flag, spec = flag_for(name, default, row)   # vLLM's spelling, where it means the same: a second flag
        flags = [flag, *(["--" + row.alias.replace("_", "-")] if row.alias else [])]
        taken = [f for f in flags if f in parser._option_string_actions]   # a script's own --seed: its workload's
        flags = [f for f in flags if f not in taken]
        dest = name if flags else "engine_" + name     # renamed, it keeps apart from the script's own value
        g.add_argument(*(flags or ["--engine-" + flag.removeprefix("--")]), dest=dest, **spec)


class _OnlyGroup:
    """An argument group that adds only the named options."""

    def __init__(self, group, only: tuple[str, ...]):
        self.group, self.only = group, only

    def add_argument(self, flag: str, *aliases: str, **kwargs) -> None:
        if kwargs.get("dest", flag.removeprefix("--").replace("-", "_")).removeprefix("engine_") in self.only:
            self.group.add_argument(flag, *aliases, **kwargs)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keywords given on the command line (only those given). --threads is not one:
    it was applied to the whole process as it was parsed, so an engine without the keyword runs on it too."""
    given = {name: getattr(args, "engine_" + name, getattr(args, name, None)) for name in ENGINE_OPTIONS
             if name not in PROCESS_OPTIONS}
    return {name: value for name, value in given.items() if value is not None}
# --8<-- [end:engine-options]
