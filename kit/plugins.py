"""kit/plugins.py - features a later chapter supplies, found by name when an engine is built.

The assembled engine of Chapter 9 takes `quant="int8"`, but weight formats are Chapter 12's
lesson: Chapter 9 must not import Chapter 12. vLLM solves the same problem with a registry of
quantisation methods looked up by name; here it is one table of `module:attribute` specs,
resolved the way `--engine module:Class` is, and only when a feature is asked for.
"""

from __future__ import annotations

import importlib

# --8<-- [start:plugins]
# feature -> where its implementation lives (module:attribute)
PLUGINS = {
    "speculator": "14_speculative_decoding:speculator",   # (method, k, draft model) -> engine -> Speculator
    "weight_format": "16_quantization:weight_format",   # (quant, group_size, head) -> model -> model
    "compile": "17_compile:compile_model",   # model -> the same model, compiled (Chapter 13)
    "tensor_parallel": "18_tensor_parallel_engine:tensor_parallel",   # (model, size, device, quant) -> engine -> None
    # Chapter 11: SamplingParams.structured, a (kind, text) pair
    "structured_check": "15_structured_output:check_structured",   # spec -> None, or ValueError
    "structured_output": "15_structured_output:make_constraint",   # (tokenizer, vocab, eos ids, spec) -> constraint
    "structured_output_hf": "15_structured_output:hf_processor",   # the same, as an HF logits processor
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


def plugin(feature: str):
    """The implementation of a feature named in PLUGINS."""
    return load_object(PLUGINS[feature])
# --8<-- [end:plugins]
