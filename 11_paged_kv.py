"""11_paged_kv.py - Chapter 7: a paged KV cache. Blocks, block tables, slot mapping.

Chapter 6 gave every sequence one contiguous KV region sized for the longest sequence
it might become. Most of that region is never written: a request that stops after 40
tokens still holds room for 700. vLLM's PagedAttention borrowed the answer from virtual
memory:

    KV pool       per layer one preallocated tensor of num_blocks x block_size slots;
                  its size comes from a memory budget (--kv-memory), not from the requests
    block table   per sequence, the list of pool blocks holding its tokens, in order;
                  token t lives in block table[t // block_size] at offset t % block_size
    block manager a free list and reference counts: a sequence takes one more block only
                  when its last one is full, and gives every block back when it finishes

Attention writes each new key/value to its slot (block * block_size + offset, Chapter 6's
slot mapping with pages instead of rows) and reads a sequence's keys through its block
table. The model's forward is unchanged: it only asks the cache for each sequence's context,
which here means copying the sequence's blocks into the rectangle SDPA wants (a GPU
paged-attention kernel reads them where they lie instead).

    python 11_paged_kv.py                            # a block manager walked by hand
    python 11_paged_kv_demo.py                       # capacity: contiguous vs paged, live block tables
    python 11_paged_kv_demo.py --plot ch7-paged.png  # the same as a picture for the book
"""

from __future__ import annotations

import collections
import functools
import importlib
from dataclasses import dataclass

import torch

model10 = importlib.import_module("10_model")

DEFAULT_KV_MEMORY = 512 << 20    # bytes for the KV pool: 728 blocks of 16, 11,648 tokens of the default model in fp32
DEFAULT_BLOCK_SIZE = 16          # tokens per block, vLLM's default


class PoolFullError(RuntimeError):
    """The KV pool has no free block: the caller must wait, free, or preempt (Chapter 9)."""


# --8<-- [start:pool]
class KVPool:
    """Every layer's keys and values, in num_blocks blocks of block_size token slots each.

    Stored flat, [num_blocks * block_size, kv_heads, head_dim] per layer, so the model's
    one index_copy_ per layer writes new keys into their slots exactly as in Chapter 6.
    """

    def __init__(self, config: model10.ModelConfig, num_blocks: int, block_size: int,
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
    def from_memory(cls, config: model10.ModelConfig, kv_memory: int, block_size: int = DEFAULT_BLOCK_SIZE,
                    dtype=torch.float32, device="cpu") -> KVPool:
        """As many blocks as kv_memory bytes buy."""
        per_block = config.kv_bytes_per_token(dtype) * block_size
        if kv_memory < per_block:
            raise ValueError(f"kv_memory {kv_memory:,} bytes is less than one block "
                             f"({block_size} tokens = {per_block:,} bytes)")
        return cls(config, kv_memory // per_block, block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

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
class PagedBatch(model10.RaggedBatch):
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


# --8<-- [start:block-manager]
class BlockManager:
    """Which pool block belongs to whom. Pure bookkeeping: it never touches a tensor."""

    caches_prefixes = False    # Chapter 8's manager also finds blocks computed for earlier prompts

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block manager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = collections.deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}      # sequence id -> its blocks, in token order
        self.lengths: dict[int, int] = {}           # sequence id -> tokens it holds slots for

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, num_tokens: int, shared: int = 0) -> bool:
        """The 'not now' answer: would a sequence of num_tokens (the first `shared` blocks
        borrowed from another sequence) fit in the free blocks right now?"""
        return self.blocks_for(num_tokens) - shared <= self.num_free

    def can_allocate_prompt(self, tokens: list[int]) -> bool:
        """can_allocate for a sequence whose tokens are known, as allocate_prompt would take it:
        here all its blocks are new. Chapter 8's prefix cache counts the ones it already holds."""
        return self.can_allocate(len(tokens))

    def _known(self, seq_id: int) -> int:
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} has no blocks (never allocated, or freed already)")
        return seq_id

    def _take(self) -> int:
        if not self.free_blocks:
            raise PoolFullError(f"the KV pool is full: all {self.num_blocks} blocks of "
                                f"{self.block_size} tokens are in use")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq_id: int, num_tokens: int, shared: list[int] = ()) -> list[int]:
        """Blocks for a new sequence's first num_tokens tokens. `shared` are full blocks of
        another sequence holding this one's first tokens (Chapter 8): borrowed, not copied."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if num_tokens < 1 or len(shared) * self.block_size > num_tokens:
            raise ValueError(f"cannot allocate {num_tokens} tokens with {len(shared)} shared blocks")
        bad = [b for b in shared if not 0 <= b < self.num_blocks or self.ref_counts[b] < 1]
        if bad or len(set(shared)) < len(shared):
            raise ValueError(f"shared blocks {list(shared)} must be distinct blocks in use (bad: {bad})")
        if not self.can_allocate(num_tokens, len(shared)):
            raise PoolFullError(f"{self.blocks_for(num_tokens) - len(shared)} blocks needed, "
                                f"{self.num_free} free of {self.num_blocks}")
        for block in shared:     # checked first, so a refusal leaves every count as it was
            self.ref_counts[block] += 1
        table = list(shared) + [self._take() for _ in range(self.blocks_for(num_tokens) - len(shared))]
        self.tables[seq_id], self.lengths[seq_id] = table, num_tokens
        return table

    def allocate_prompt(self, seq_id: int, tokens: list[int]) -> int:
        """Blocks for a new sequence's known tokens; returns how many of them already have their K/V:
        none here. Chapter 8's prefix cache finds a cached prefix and returns its length."""
        self.allocate(seq_id, len(tokens))
        return 0

    def cache_computed(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence's first len(tokens) tokens now have K/V. Nothing to remember here;
        Chapter 8's prefix cache makes the full blocks among them findable."""

    def append_slot(self, seq_id: int) -> int:
        """Room for one more token; a new block only when the last one is full. Returns its slot."""
        table, n = self.tables[self._known(seq_id)], self.lengths[seq_id]
        if n == len(table) * self.block_size:
            table.append(self._take())          # PoolFullError leaves the table unchanged
        self.lengths[seq_id] = n + 1
        return table[n // self.block_size] * self.block_size + n % self.block_size

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep slots for the first num_tokens tokens only; whole blocks past them go back
        (speculative decoding, Chapter 10, gives back the slots of rejected guesses)."""
        table = self.tables[self._known(seq_id)]
        if not 1 <= num_tokens <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of {self.lengths[seq_id]} tokens to {num_tokens}")
        while len(table) > self.blocks_for(num_tokens):
            self._release(table.pop())
        self.lengths[seq_id] = num_tokens

    def _release(self, block: int) -> None:
        """One owner fewer; a block nobody owns is free again."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def free(self, seq_id: int) -> None:
        """Give back a finished (or aborted, or preempted) sequence's blocks; shared ones stay
        in use until their last owner lets go."""
        for block in self.tables.pop(self._known(seq_id)):
            self._release(block)
        del self.lengths[seq_id]
# --8<-- [end:block-manager]


def main() -> None:
    """A block manager walked by hand: no model, only the bookkeeping."""
    import argparse

    parser = argparse.ArgumentParser(description="Chapter 7: blocks and block tables, by hand. "
                                                 "Capacity and live tables on the model: python 11_paged_kv_demo.py")
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()
    blocks = BlockManager(num_blocks=8, block_size=args.block_size)
    show = lambda what: print(f"  {what:<34} tables {blocks.tables}  free {list(blocks.free_blocks)}")  # noqa: E731
    print(f"[a pool of 8 blocks x {args.block_size} tokens]")
    blocks.allocate_prompt(0, list(range(6)))
    show("sequence 0: a 6-token prompt")
    blocks.allocate_prompt(1, list(range(3)))
    show("sequence 1: a 3-token prompt")
    for _ in range(3):
        blocks.append_slot(0)
    show("sequence 0: 3 decode steps")
    blocks.free(1)
    show("sequence 1 finishes")
    blocks.allocate_prompt(2, list(range(9)))
    show("sequence 2: a 9-token prompt")
    slot = blocks.append_slot(2)
    print(f"  sequence 2's next token goes to slot {slot} "
          f"(block {slot // args.block_size}, offset {slot % args.block_size})")


if __name__ == "__main__":
    main()
