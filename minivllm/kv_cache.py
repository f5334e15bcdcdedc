"""Chapter 7: a paged KV cache. A pool of blocks, and the batch that reads it through block tables.

Chapter 6 gave every sequence one contiguous KV region sized for the longest sequence it might
become. Here every layer has one preallocated pool of num_blocks x block_size slots, sized from
a memory budget; a sequence's block table lists the blocks that hold its tokens, in order, and
token t lives in block table[t // block_size] at offset t % block_size. The model's forward is
unchanged: it asks the pool for each sequence's context.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minivllm.config import DEFAULT_BLOCK_SIZE
from minivllm.batch import RaggedBatch
from minivllm.model import ModelConfig



class PoolFullError(RuntimeError):
    """The KV pool has no free block: the caller must wait, free, or preempt (Chapter 9)."""


def blocks_in(config: ModelConfig, kv_memory: int, block_size: int, dtype=torch.float32) -> int:
    """How many blocks of block_size tokens kv_memory bytes buy (a ValueError if not one)."""
    per_block = config.kv_bytes_per_token(dtype) * block_size
    if kv_memory < per_block:
        raise ValueError(f"kv_memory {kv_memory:,} bytes is less than one block "
                         f"({block_size} tokens = {per_block:,} bytes)")
    return kv_memory // per_block


def describe_pool(pool) -> str:
    """The pool as an engine announces it: whole blocks only, so a little under kv_memory."""
    mib = pool.nbytes / 2**20
    return (f"{pool.num_blocks} blocks x {pool.block_size} tokens = {pool.num_blocks * pool.block_size:,} "
            f"tokens in {mib:.{1 if mib < 100 else 0}f} MiB")


# --8<-- [start:pool]
class KVPool:
    """Every layer's keys and values, in num_blocks blocks of block_size token slots each.

    Stored flat, [num_blocks * block_size, kv_heads, head_dim] per layer, so the model's
    one index_copy_ per layer writes new keys into their slots exactly as in Chapter 6.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype=torch.float32, device="cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        # zeros, not empty: the slots of a last block past its sequence's end are read (then
        # masked), and uninitialised memory can hold NaN bit patterns, which survive a zero weight.
        try:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        except (RuntimeError, MemoryError) as exc:   # torch's out-of-memory errors are RuntimeErrors
            raise ValueError(f"a KV pool of {num_blocks:,} blocks x {block_size} tokens does not fit in "
                             f"this device's memory ({str(exc).splitlines()[0]}); lower kv_memory") from None
        # Where context() copies a batch's blocks: two buffers reused by every layer and every step
        # (fresh ones per layer cost more in page faults than the copy itself). Zeros, for the same reason.
        self.scratch = [torch.zeros(0, block_size * shape[1] * shape[2], dtype=dtype, device=device)] * 2

    @classmethod
    def from_memory(cls, config: ModelConfig, kv_memory: int, block_size: int = DEFAULT_BLOCK_SIZE,
                    dtype=torch.float32, device="cpu") -> KVPool:
        """As many blocks as kv_memory bytes buy."""
        return cls(config, blocks_in(config, kv_memory, block_size, dtype), block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Chapter 16's copy-on-write: block `to` gets block `from`'s keys and values, every layer."""
        if not copies:   # the common step: no answer wrote into a shared block
            return
        src, dst = (torch.tensor(ids, device=self.k[0].device) for ids in zip(*copies))
        for flat in self.k + self.v:
            pages = flat.view(self.num_blocks, -1)
            pages[dst] = pages[src]

    def batch(self, new_tokens: list[list[int]], tables: list[list[int]], starts: list[int], device) -> PagedBatch:
        """The batch of these new tokens, sequence i's K/V in the blocks of tables[i] (the model runner asks)."""
        return PagedBatch.from_tables(new_tokens, tables, starts, self.block_size, device)
    # --8<-- [end:pool]

    # --8<-- [start:context]
    def context(self, layer: int, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's keys and values read through its block table: [seqs, ctx, kv_heads, head_dim].

        Attention wants one rectangle, so the blocks are copied into one: a single gather of
        every row's table, padding included (a GPU paged-attention kernel reads them in place).
        """
        n, width = batch.block_tables.shape
        shape = (n, width * self.block_size, *self.k[layer].shape[1:])
        pages = [flat.view(self.num_blocks, -1) for flat in (self.k[layer], self.v[layer])]   # a row per block
        if batch.first_of_run is not None:   # one sequence in consecutive blocks: a view, no copy
            first = batch.first_of_run
            return tuple(p[first: first + width].view(shape)[:, :batch.context_len] for p in pages)
        if self.scratch[0].shape[0] < n * width:
            self.scratch = [self.scratch[0].new_zeros(n * width, self.scratch[0].shape[1]) for _ in range(2)]
        out = []
        for blocks, scratch in zip(pages, self.scratch):   # one gather for the whole batch
            torch.index_select(blocks, 0, batch.block_tables.view(-1), out=scratch[:n * width])
            out.append(scratch[:n * width].view(shape)[:, :batch.context_len])
        return out[0], out[1]
    # --8<-- [end:context]


# --8<-- [start:batch]
@dataclass
class PagedBatch(RaggedBatch):
    """Chapter 6's ragged batch, with slots and context read through block tables."""

    block_tables: torch.Tensor | None = None    # [seqs, blocks covering the longest context]

    @classmethod
    def from_tables(cls, new_tokens: list[list[int]], tables: list[list[int]], starts: list[int],
                    block_size: int, device="cpu") -> PagedBatch:
        lengths = [len(t) for t in new_tokens]
        if not lengths or min(lengths) < 1:
            raise ValueError("every sequence in a batch needs at least one new token")
        needed = [-(-(s + n) // block_size) for s, n in zip(starts, lengths)]   # ceil division
        if any(k > len(t) for k, t in zip(needed, tables)):
            raise ValueError("a sequence's new tokens run past the blocks allocated to it")
        # Rows shorter than the widest are padded with their own first block: real, finite keys
        # that context() copies along and attention's mask hides.
        width = max(needed)
        padded = torch.tensor([t[:k] + [t[0]] * (width - k) for t, k in zip(tables, needed)], dtype=torch.long)
        # The slot mapping, for every new token at once: block table[p // block_size], offset p % block_size.
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        slots = padded[seq, positions // block_size] * block_size + positions % block_size
        tokens = torch.tensor([t for ids in new_tokens for t in ids], dtype=torch.long)
        return cls(tokens.to(device), positions.to(device), slots.to(device), list(range(len(lengths))),
                   list(starts), lengths, padded.to(device))

    @functools.cached_property   # every layer's context() asks: computed once per forward
    def first_of_run(self) -> int | None:
        """For a lone sequence whose blocks are consecutive in the pool: its first block."""
        if len(self.lengths) > 1:
            return None
        table = self.block_tables[0].tolist()
        return table[0] if table == list(range(table[0], table[0] + len(table))) else None
# --8<-- [end:batch]
