"""11_paged_kv_engine.py - Chapter 7's engine: Chapter 6's engine with its KV cache in a pool of blocks.

The pool, the paged batch and the block manager are in 11_paged_kv.py; this file is the
decode loop that uses them. `11_paged_kv:PagedEngine` works as an engine spec.

    python 06_benchmark_offline.py --engine 10_model:ModelEngine --engine 11_paged_kv:PagedEngine --ignore-eos
"""

from __future__ import annotations

import collections
import importlib
import itertools
import time

import torch

engine10 = importlib.import_module("10_model_engine")
paged = importlib.import_module("11_paged_kv")


class PagedEngine(engine10.ModelEngine):
    """Chapter 6's engine with its KV cache in a fixed pool of blocks."""

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 32,
                 kv_memory: int = paged.DEFAULT_KV_MEMORY, block_size: int = paged.DEFAULT_BLOCK_SIZE):
        if not isinstance(block_size, int) or not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {block_size!r}")
        super().__init__(model_name, device, dtype, max_batch_size, kv_memory)
        m = self.model
        self.pool = paged.KVPool.from_memory(m.config, kv_memory, block_size, m.dtype, m.device)
        self.blocks = paged.BlockManager(self.pool.num_blocks, block_size)
        self._ids = itertools.count()
        print(f"[engine] KV pool: {self.pool.num_blocks} blocks x {block_size} tokens = "
              f"{self.pool.num_blocks * block_size:,} tokens in {self.pool.nbytes / 2**20:.0f} MiB", flush=True)

    def _encode_ids(self, prompt: str, budget: int) -> list[int]:
        ids = super()._encode_ids(prompt, budget)
        need = self.blocks.blocks_for(len(ids) + budget)
        if need > self.blocks.num_blocks:   # could never fit, however long it waited
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({budget}) needs {need} KV blocks; "
                             f"the pool has {self.blocks.num_blocks}: raise kv_memory or lower max_new_tokens")
        return ids

    # --8<-- [start:run]
    def run(self, prompts: list[list[int]], seqs: list) -> collections.abc.Iterator[list[str]]:
        """Chapter 6's loop; the cache is the pool, and blocks come and go with the tokens."""
        ids = [next(self._ids) for _ in seqs]
        try:
            starts = [self.admit(i, p, s) for i, p, s in zip(ids, prompts, seqs)]
            batch = paged.PagedBatch.from_tables([p[c:] for p, c in zip(prompts, starts)], [self.blocks.tables[i] for i in ids],
                                           starts, self.pool.block_size, self.device)
            logits, live = self.model.forward(batch, self.pool), list(range(len(seqs)))
            while True:
                self.computed(ids, prompts, seqs, live)
                tokens = self.sample(logits, [seqs[i] for i in live])
                now, pieces = time.perf_counter(), [""] * len(seqs)
                for i, token in zip(live, tokens):
                    pieces[i] = self.accept(seqs[i], token, now)
                    if seqs[i].finish_reason:
                        self.blocks.free(ids[i])     # finished: its blocks serve others at once
                yield pieces
                step = [(i, t) for i, t in zip(live, tokens) if seqs[i].finish_reason is None]
                if not step:
                    return
                live = [i for i, _ in step]
                starts = [self.blocks.lengths[ids[i]] for i in live]
                for i in live:
                    self.blocks.append_slot(ids[i])
                batch = paged.PagedBatch.from_tables([[t] for _, t in step], [self.blocks.tables[ids[i]] for i in live],
                                               starts, self.pool.block_size, self.device)
                logits = self.model.forward(batch, self.pool)
        finally:   # finished, failed or abandoned by its reader: no block outlives the call
            for i in ids:
                if i in self.blocks.tables:
                    self.blocks.free(i)
    # --8<-- [end:run]

    # --8<-- [start:hooks]
    def admit(self, seq_id: int, prompt: list[int], seq) -> int:
        """Blocks for a new sequence's prompt; returns how many of its tokens already have
        keys and values (none here: Chapter 8 finds a cached prefix)."""
        self.blocks.allocate(seq_id, len(prompt))
        return 0

    def computed(self, ids: list[int], prompts: list[list[int]], seqs: list, live: list[int]) -> None:
        """After every forward, every token fed so far has its K/V (Chapter 8 publishes full blocks)."""
    # --8<-- [end:hooks]

    # --8<-- [start:chunks]
    def batch_chunks(self, encoded: list[list[int]], budget: int) -> collections.abc.Iterator[slice]:
        """Admit prompts while the free blocks can hold each one's own prompt + budget."""
        start = 0
        while start < len(encoded):
            end, need = start, 0
            while end < len(encoded) and end - start < self.max_batch_size:
                need += self.blocks.blocks_for(len(encoded[end]) + budget)
                if need > self.blocks.num_free and end > start:
                    break
                end += 1
            yield slice(start, end)
            start = end
    # --8<-- [end:chunks]

    def stats(self) -> dict:
        """For the server's /engine/stats and /metrics."""
        return {"kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free,
                "kv_blocks_free": self.blocks.num_free}
