"""kit/hf.py - Hugging Face's model API as the scripts call it, whichever transformers is installed.

Chapters 2 and 3 drive HF's model themselves, one forward at a time, and hand it their own KV
cache. transformers 5 renamed that keyword; the scripts ask here which name the installed
version takes.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def cache_keyword(model_class: type) -> str:
    """forward()'s keyword for the KV cache: transformers 5 renamed `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
