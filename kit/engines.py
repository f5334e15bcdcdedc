"""kit/engines.py - any chapter's engine from a 'module:Class' spec, with the features it takes.

This is how the server and the benchmarks stay unchanged as chapters add engines: they name an
engine (`--engine 07_decode_loop:DecodeLoopEngine`) and pass options by the flags' names. A spec
may carry flags of its own after the class, the same flags as the command line's, for that engine
only (`--engine "16_quantization_engine:QuantizedEngine --quant int4"` beside another engine on
int8). An engine that takes `structured_output` gets Chapter 11's grammars here, so that every
engine honours `response_format` without an earlier chapter importing a later one.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import shlex

from kit import cli
from minivllm.contracts import BaseOfflineEngine
from minivllm.structured import StructuredOutput

DEFAULT_ENGINE = "04_engine:BaselineEngine"


def load_object(spec: str, kind: str = "attribute"):
    """The attribute a 'module:attribute' spec names; ValueError if there is none."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or module_name.startswith("."):
        raise ValueError(f"a spec must look like 'module:{kind}', got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from exc


class _SpecParser(argparse.ArgumentParser):
    """The engine flags of kit/cli.py, whose mistakes are a ValueError rather than an exit."""

    def error(self, message: str):
        raise ValueError(message)


# --8<-- [start:load-engine]
def split_spec(spec: str) -> tuple[str, dict]:
    """'module:Class --flag value ...' -> ('module:Class', the engine keywords its flags give):
    the flags are the command line's engine flags (kit/cli.py), read the same way."""
    try:
        words = shlex.split(spec)
    except ValueError as exc:   # an unclosed quote
        raise ValueError(f"cannot read engine spec {spec!r}: {exc}") from None
    if not words:
        raise ValueError("an engine spec must name module:Class")
    parser = _SpecParser(prog=words[0], add_help=False, allow_abbrev=False)
    cli.add_engine_options(parser)
    try:
        return words[0], cli.engine_options(parser.parse_args(words[1:]))
    except ValueError as exc:
        raise ValueError(f"engine spec {spec!r}: {exc}") from None


def load_engine(spec: str = DEFAULT_ENGINE, model: str | None = None,
                device: str | None = None, **kwargs) -> BaseOfflineEngine:
    """Build any chapter's engine from 'module:Class', e.g. '07_decode_loop:DecodeLoopEngine'
    or 'minivllm:LLM'. kwargs are features for it; flags in the spec itself win over them."""
    class_spec, own = split_spec(spec)
    kwargs = {**kwargs, **own}
    try:
        engine_class = load_object(class_spec, "Class")   # 'module:attribute', imported
    except ValueError as exc:
        raise ValueError(f"cannot load engine {spec!r}: {exc}") from None
    if not (isinstance(engine_class, type) and issubclass(engine_class, BaseOfflineEngine)) \
            or inspect.isabstract(engine_class):
        raise ValueError(f"{spec!r} is not an engine: a concrete BaseOfflineEngine subclass")
    try:
        inspect.signature(engine_class).bind(model, device=device, **kwargs)
    except TypeError as exc:   # e.g. --kv-memory for an engine without a KV pool
        raise ValueError(f"{class_spec} does not take {', '.join(kwargs) or 'Class(model, device=...)'}: {exc}") from None
    if "structured_output" in inspect.signature(engine_class).parameters:
        kwargs.setdefault("structured_output", StructuredOutput())
    return engine_class(model, device=device, **kwargs)
# --8<-- [end:load-engine]
