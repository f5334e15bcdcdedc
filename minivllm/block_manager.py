"""Chapter 7: the block manager. A free list and reference counts over the KV pool's blocks.

A sequence takes one more block only when its last one is full, and gives every block back the
moment it finishes. It is bookkeeping only: block ids, never tensors. Chapter 8's prefix cache
is a block manager that also remembers.
"""

from __future__ import annotations

import collections

from minivllm.kv_cache import PoolFullError

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
        self.copies: list[tuple[int, int]] = []     # (from, to): blocks whose K/V the next step copies first

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, n_prompt: int, budget: int) -> None:
        """A ValueError for a request the whole pool could never hold, however long it waited."""
        need = self.blocks_for(n_prompt + budget)
        if need > self.num_blocks:
            raise ValueError(f"prompt ({n_prompt} tokens) + max_new_tokens ({budget}) needs {need} KV blocks; "
                             f"the pool has {self.num_blocks}: raise kv_memory or lower max_new_tokens")

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, num_tokens: int, shared: int = 0) -> bool:
        """The 'not now' answer: would a sequence of num_tokens (the first `shared` blocks
        borrowed from another sequence) fit in the free blocks right now?"""
        return self.blocks_for(num_tokens) - shared <= self.num_free

    def can_allocate_prompt(self, tokens: list[int], salt: str | None = None) -> bool:
        """can_allocate for a sequence whose tokens are known, as allocate_prompt would take it:
        here all its blocks are new. Chapter 8's prefix cache counts the ones it already holds
        (for requests of the same `salt`)."""
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

    def allocate_prompt(self, seq_id: int, tokens: list[int], salt: str | None = None) -> int:
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

    # --8<-- [start:fork]
    def fork(self, seq_id: int, child_id: int) -> list[int]:
        """Chapter 16: a new sequence that holds every block of seq_id, by reference: nothing is
        copied now. Whichever of them writes into a shared block first gets its own copy (own())."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = self.tables[self._known(seq_id)]
        for block in table:
            self.ref_counts[block] += 1
        self.tables[child_id], self.lengths[child_id] = list(table), self.lengths[seq_id]
        return self.tables[child_id]

    def own(self, seq_id: int, start: int, end: int) -> None:
        """Copy-on-write: the sequence is about to write its tokens [start, end); each shared block
        they fall in becomes its own. A block that already holds earlier tokens is copied (the step
        copies its K/V first: `copies`); the last owner writes in place."""
        table, bs = self.tables[self._known(seq_id)], self.block_size
        for i in range(start // bs, self.blocks_for(end)):
            if self.ref_counts[table[i]] > 1:
                fresh = self._take()
                if start > i * bs:                     # tokens before start live there: keep their K/V
                    self.copies.append((table[i], fresh))
                self.ref_counts[table[i]] -= 1         # still >= 1: another sequence holds it
                table[i] = fresh

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies owed before the next forward, handed over once."""
        copies, self.copies = self.copies, []
        return copies
    # --8<-- [end:fork]

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
