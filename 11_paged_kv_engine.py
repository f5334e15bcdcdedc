"""11_paged_kv_engine.py - Chapter 7's engine: Chapter 6's engine with its KV cache in a pool of blocks.

The pool, the paged batch and the block manager are in 11_paged_kv.py. Composed here: the
model runner gets the pool instead of a cache of rows (its step is unchanged), and a block
manager hands out blocks as tokens arrive and takes them back the moment a request ends.

    python 11_paged_kv_engine.py --kv-memory 256MB --block-size 16   # one prompt, as 04_engine.py
    python 06_benchmark_offline.py --engine 10_model_engine:ModelEngine --engine 11_paged_kv_engine:PagedEngine --ignore-eos
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator, Sequence

import torch

from kit.demo import engine_main
from minivllm.block_manager import BlockManager
from minivllm.contracts import SamplingParams, is_integer
from minivllm.config import DEFAULT_BLOCK_SIZE, DEFAULT_KV_MEMORY
from minivllm.kv_cache import KVPool, describe_pool
from minivllm.output import Request

engine10 = importlib.import_module("10_model_engine")


class PagedEngine(engine10.ModelEngine):
    """Chapter 6's engine with its KV cache in a fixed pool of blocks."""

    block_manager = BlockManager   # Chapter 8 composes one that also remembers prefixes

    # --8<-- [start:init]
    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, max_num_seqs: int = 32,
                 kv_memory: int = DEFAULT_KV_MEMORY, block_size: int = DEFAULT_BLOCK_SIZE,
                 weight_steps: Sequence = (), structured_output=None):
        if not is_integer(block_size) or not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {block_size!r}")
        super().__init__(model_name, device, dtype, max_num_seqs, kv_memory, weight_steps, structured_output)
        m = self.model
        self.pool = KVPool.from_memory(m.config, kv_memory, block_size, m.dtype, m.device)
        self.runner.kv = self.pool                # the runner's storage is now blocks, for good
        self.blocks = self.block_manager(self.pool.num_blocks, block_size)
        print(f"[engine] KV pool: {describe_pool(self.pool)}", flush=True)
        if hasattr(m, "warm_up"):   # compiled steps (Chapter 13): the kernels are built now, not mid-request
            print("[engine] compiling the step (torch.compile) ...", flush=True)
            print(f"[engine] compiled in {self.runner.warm_up():.0f} s", flush=True)
    # --8<-- [end:init]

    def new_request(self, prompt: str | list[int], max_new_tokens: int,
                    params: SamplingParams | None = None, arrival: float | None = None) -> Request:
        r = super().new_request(prompt, max_new_tokens, params, arrival)
        self.blocks.check_fits(r.n_prompt, r.budget)
        return r

    # --8<-- [start:run]
    def run(self, requests: list[Request]) -> Iterator[list[str]]:
        """Chapter 6's loop; the cache is the pool, and blocks come and go with the tokens."""
        try:
            for r in requests:      # a prefix cache may already hold the first tokens' K/V (Chapter 8)
                r.num_computed = self.blocks.allocate_prompt(r.id, r.prompt_ids, r.params.cache_salt)
                r.cached_tokens = r.num_computed if self.blocks.caches_prefixes else None
            live = list(requests)
            while live:
                for r in live:      # a slot for every token about to be fed: a new block when one fills
                    while self.blocks.lengths[r.id] < r.num_tokens:
                        self.blocks.append_slot(r.id)
                starts = [r.num_computed for r in live]
                lengths = [r.num_tokens - r.num_computed for r in live]
                tokens = self.runner.step(live, starts, lengths, [self.blocks.tables[r.id] for r in live])
                now, pieces = time.perf_counter(), {}
                for r, token in zip(live, tokens):
                    r.num_computed = r.num_tokens
                    self.blocks.cache_computed(r.id, r.tokens(0, r.num_computed))
                    pieces[r.id] = self.output.accept(r, token, now)
                    if r.finish_reason:
                        self.blocks.free(r.id)     # finished: its blocks serve others at once
                yield [pieces.get(r.id, "") for r in requests]
                live = [r for r in live if r.finish_reason is None]
        finally:   # finished, failed or abandoned by its reader: no block outlives the call
            for r in requests:
                if r.id in self.blocks.tables:
                    self.blocks.free(r.id)
    # --8<-- [end:run]

    # --8<-- [start:chunks]
    def batch_chunks(self, requests: list[Request]) -> Iterator[slice]:
        """Admit requests while the free blocks can hold each one's own prompt + budget."""
        start = 0
        while start < len(requests):
            end, need = start, 0
            while end < len(requests) and end - start < self.max_num_seqs:
                need += self.blocks.blocks_for(requests[end].n_prompt + requests[end].budget)
                if need > self.blocks.num_free and end > start:
                    break
                end += 1
            yield slice(start, end)
            start = end
    # --8<-- [end:chunks]

    def features(self) -> dict:
        return {**super().features(), "kv_memory": self.pool.nbytes, "block_size": self.pool.block_size,
                "prefix_caching": self.blocks.caches_prefixes}

    def stats(self) -> dict:
        """For the server's /engine/stats and /metrics."""
        return {"kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free,
                "kv_blocks_free": self.blocks.num_free}


def main() -> None:
    engine_main(PagedEngine, "Chapter 7: Chapter 6's engine on a pool of KV blocks.")


if __name__ == "__main__":
    main()
