"""kit/engines.py - any chapter's engine from a 'module:Class' spec, with the features it takes.

This is how the server and the benchmarks stay unchanged as chapters add engines: they name an
engine (`--engine 07_decode_loop:DecodeLoopEngine`) and pass options by the flags' names. An
engine that takes `structured_output` gets Chapter 11's grammars here, so that every engine
honours `response_format` without an earlier chapter importing a later one.
"""

from __future__ import annotations

import importlib
import inspect

from minivllm.contracts import BaseOfflineEngine
from minivllm.structured import StructuredOutput

# --8<-- [start:load-engine]
# Engines that moved as the book grew: the old specs, in notes and in earlier captures, keep
# working. One table, read only here.
MOVED_ENGINES = {
    "10_model:ModelEngine": "10_model_engine:ModelEngine",
    "11_paged_kv:PagedEngine": "11_paged_kv_engine:PagedEngine",
    "12_prefix_cache:PrefixCachingEngine": "12_prefix_cache_engine:PrefixCachingEngine",
    "13_continuous_batching:ContinuousBatchingEngine": "13_continuous_batching_engine:ContinuousBatchingEngine",
    **{f"16_quantization:{name}": f"16_quantization_engine:{name}"
       for name in ("QuantizedEngine", "BF16Engine", "Int8Engine", "Int4Engine")},
}


def load_object(spec: str, kind: str = "attribute"):
    """The attribute a 'module:attribute' spec names; ValueError if there is none."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or module_name.startswith("."):
        raise ValueError(f"a spec must look like 'module:{kind}', got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from exc


def load_engine(spec: str = "04_engine:BaselineEngine", model: str | None = None,
                device: str | None = None, **kwargs) -> BaseOfflineEngine:
    """Build any chapter's engine from 'module:Class', e.g. '07_decode_loop:DecodeLoopEngine'
    or 'minivllm:LLM'."""
    try:
        engine_class = load_object(MOVED_ENGINES.get(spec, spec), "Class")   # 'module:attribute', imported
    except ValueError as exc:
        raise ValueError(f"cannot load engine {spec!r}: {exc}") from None
    if not (isinstance(engine_class, type) and issubclass(engine_class, BaseOfflineEngine)) \
            or inspect.isabstract(engine_class):
        raise ValueError(f"{spec!r} is not an engine: a concrete BaseOfflineEngine subclass")
    try:
        inspect.signature(engine_class).bind(model, device=device, **kwargs)
    except TypeError as exc:   # e.g. --kv-memory for an engine without a KV pool
        raise ValueError(f"{spec} does not take {', '.join(kwargs) or 'Class(model, device=...)'}: {exc}") from None
    if "structured_output" in inspect.signature(engine_class).parameters:
        kwargs.setdefault("structured_output", StructuredOutput())
    return engine_class(model, device=device, **kwargs)
# --8<-- [end:load-engine]
