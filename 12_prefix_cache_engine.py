"""12_prefix_cache_engine.py - Chapter 8's engine: Chapter 7's engine with a block manager that remembers.

Nothing in Chapter 7's loop changes. Its block manager is swapped for the prefix-caching one
(12_prefix_cache.py): admission asks it for blocks and it answers with how many leading tokens
already have their keys and values, so the prefill starts after them; after every step the
blocks that became full are published for later prompts.

    python 12_prefix_cache_engine.py                           # one prompt, as 04_engine.py
    python 12_prefix_cache_demo.py                             # a shared system prompt: TTFT on/off
    python 05_server.py --engine 12_prefix_cache_engine:PrefixCachingEngine
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from kit.demo import engine_main
from minivllm.config import DEFAULT_BLOCK_SIZE, DEFAULT_KV_MEMORY
from minivllm.prefix_cache import PrefixCachingBlockManager

engine11 = importlib.import_module("11_paged_kv_engine")


# --8<-- [start:engine]
class PrefixCachingEngine(engine11.PagedEngine):
    """Chapter 7's engine; a prompt's cached prefix is shared, not recomputed."""

    block_manager = PrefixCachingBlockManager

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, max_num_seqs: int = 32,
                 kv_memory: int = DEFAULT_KV_MEMORY, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True, weight_steps: Sequence = (), structured_output=None):
        super().__init__(model_name, device, dtype, max_num_seqs, kv_memory, block_size, weight_steps,
                         structured_output)
        self.prefix_caching = prefix_caching

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.caches_prefixes

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        """Off answers as Chapter 7's block manager, for comparisons in one process; the blocks cached
        so far keep their K/V, and are found again once it is back on."""
        if not isinstance(on, bool):
            raise ValueError(f"prefix_caching must be True or False, got {on!r}")
        if self.blocks.tables:
            raise RuntimeError("cannot switch prefix caching while requests hold blocks")
        self.blocks.enabled = on
# --8<-- [end:engine]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM has the same call), e.g. between two measurements."""
        self.blocks.reset()

    def stats(self) -> dict:
        if not self.prefix_caching:
            return super().stats()
        b = self.blocks
        return {**super().stats(), "prefix_cache_hit_rate": round(b.hit_rate, 4),
                "prefix_cache_blocks": len(b.content), "kv_blocks_evictable": len(b.evictable)}


def main() -> None:
    engine_main(PrefixCachingEngine, "Chapter 8: Chapter 7's engine with a prefix cache.")


if __name__ == "__main__":
    main()
