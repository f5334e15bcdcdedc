"""kit/cli.py - argparse types for the scripts' flags: a bad value is refused before any work.

An instructor types these flags live. A negative count, a NaN rate or a plot path in a folder
that does not exist should fail at once, in one line naming the flag, not with a traceback
after the model has loaded and the benchmark has run. Each type below checks one kind of
value; argparse turns its ArgumentTypeError into `error: argument --flag: ...`.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from minivllm.config import (DEFAULT_GPU_MEMORY_UTILIZATION, GROUP_SIZES, MAX_BLOCK_SIZE, MAX_SEQS,  # noqa: F401
                             MAX_SPECULATIVE_TOKENS, MAX_TENSOR_PARALLEL, QUANT_FORMATS, QUANT_HEADS,
                             SPECULATIVE_METHODS, EngineConfig)
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
    --threads N sets torch's CPU threads as it is parsed. On a 2-core machine shared with
    other work, torch's two threads mostly wait for each other; one thread is steadier."""
    parser.add_argument("--model", default=None, help="HF id or local folder (default: SmolLM2-135M-Instruct)")
    if device:
        parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    if threads:
        parser.add_argument("--threads", type=integer(1, 1024), default=None, action=_TorchThreads,
                            help="torch CPU threads (default: torch's choice; 1 is steadier on a busy, shared machine)")


def parse_bytes(text: str) -> int:
    """'512MB', '1.5GiB', '64m' or a plain byte count -> bytes (MB = MiB here, as torch counts)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a memory size: {text!r} (try 512MB or 2GB)")
    value = float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")
    if not 1 <= value <= 1 << 40:
        raise ValueError(f"memory size {text!r} is out of range (1 byte .. 1 TiB)")
    return int(value)


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
# as a flag of 05_server.py and of both benchmarks (--kv-memory is kv_memory=...). The names,
# choices and bounds are the engine's own (minivllm/config.py): written once, read here.
ENGINE_OPTIONS = (*EngineConfig.names(), "dtype")   # dtype: every engine's, from Chapter 1 on


def add_engine_options(parser: argparse.ArgumentParser, only: tuple[str, ...] = ENGINE_OPTIONS) -> None:
    """The engine's switches as flags. Left out, a flag is not passed at all, so every engine
    keeps its own default, and an engine that lacks the feature is only asked when it is named.
    `only`: the features a script's own engine has (its other flags are not offered)."""
    g = _OnlyGroup(parser.add_argument_group("engine features (the engine's constructor keywords of the same names)"),
                   only)
    g.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="the weights' and activations' precision (default auto: bfloat16 on a GPU, float32 elsewhere)")
    g.add_argument("--quant", choices=QUANT_FORMATS, default=None,
                   help="weight format (Chapter 12); default: the model's float32")
    g.add_argument("--group-size", type=integer(), choices=GROUP_SIZES, default=None,
                   help="int4: inputs per scale and zero point (default 32)")
    g.add_argument("--quant-head", choices=QUANT_HEADS, default=None,
                   help="format of the embedding/LM head (default auto: the layers', int8 for int4)")
    g.add_argument("--prefix-caching", action="store_true", default=None,
                   help="share the KV blocks of prompt prefixes seen before (Chapter 8), among all clients "
                        "unless their requests carry different cache_salt")
    g.add_argument("--kv-memory", type=byte_size, default=None,
                   help="KV pool size, e.g. 512MB; MB means MiB, 2**20 bytes (Chapter 7); default 512MB, "
                        "on one GPU what --gpu-memory-utilization leaves after the weights (Chapter 15)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="the fraction of the GPU's memory the engine may use, weights, KV pool and a step's "
                        "activations together, when --kv-memory is not given "
                        f"(Chapter 15; default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    g.add_argument("--block-size", type=integer(1, MAX_BLOCK_SIZE), default=None, help="tokens per KV block (Chapter 7)")
    g.add_argument("--max-num-seqs", type=integer(1, MAX_SEQS), default=None,
                   help="sequences in one step, at most (Chapter 9)")
    g.add_argument("--max-num-batched-tokens", type=integer(1, MAX_SEQS), default=None,
                   help="tokens in one step, at most (Chapter 9)")
    g.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                   help="guess tokens and verify them in one step (Chapter 10): ngram = prompt lookup, "
                        "draft = a draft model")
    g.add_argument("--num-speculative-tokens", type=integer(1, MAX_SPECULATIVE_TOKENS), default=None,
                   help="guesses per verification, at most (default 4)")
    g.add_argument("--draft-model", default=None,
                   help="the draft model, same tokenizer (default: this model on int4 weights)")
    g.add_argument("--tensor-parallel-size", type=integer(1, MAX_TENSOR_PARALLEL), default=None,
                   help="split the model over N processes: gloo on CPU, NCCL on N GPUs (Chapter 14)")
    g.add_argument("--compile", action="store_true", default=None,
                   help="packed weights and fused ops via torch.compile (Chapter 13); "
                        "the first start compiles for a minute or two, later ones read inductor's cache")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs: every decode step launches its kernels one by one (Chapter 15); "
                        "default: graphs on CUDA, eager elsewhere")


class _OnlyGroup:
    """An argument group that adds only the named options."""

    def __init__(self, group, only: tuple[str, ...]):
        self.group, self.only = group, only

    def add_argument(self, flag: str, **kwargs) -> None:
        if flag.removeprefix("--").replace("-", "_") in self.only:
            self.group.add_argument(flag, **kwargs)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keywords given on the command line (only those given)."""
    return {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name, None) is not None}
# --8<-- [end:engine-options]
