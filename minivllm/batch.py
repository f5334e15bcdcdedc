"""Chapter 6: the ragged batch, and the KV cache of rows it is written into.

A forward pass computes the new tokens of several sequences at once, concatenated in one flat
vector with per-sequence lengths (a "ragged" batch): one request's prefill beside others'
single decode tokens. Each new key and value goes to its slot in the cache; here a sequence owns
one contiguous row of slots, and Chapter 7 replaces rows by pages (minivllm/kv_cache.py).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch


# --8<-- [start:kv-cache]
class KVCache:
    """Keys and values of `rows` sequences, each in its own contiguous region of max_len slots.

    Layout per layer: [rows * max_len, kv_heads, head_dim]. Token t of the sequence in
    row r lives in slot r * max_len + t, so writing a whole ragged batch's new keys is
    one index_copy_ with a slot mapping; Chapter 7 replaces rows by pages.
    """

    def __init__(self, config, rows: int, max_len: int, dtype=torch.float32, device="cpu"):
        if rows < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs rows >= 1 and max_len >= 1, got {rows} x {max_len}")
        shape = (rows * max_len, config.num_kv_heads, config.head_dim)
        self.rows, self.max_len = rows, max_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def batch(self, new_tokens: list[list[int]], rows: list[int], starts: list[int], device) -> RaggedBatch:
        """The ragged batch of these new tokens, sequence i in row rows[i] (the model runner asks)."""
        return RaggedBatch.build(new_tokens, rows, starts, self.max_len, device)

    def context(self, layer: int, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each batch sequence's cached keys and values up to the longest context:
        [seqs, ctx, kv_heads, head_dim] (positions past a row's own context are masked later)."""
        shape = (self.rows, self.max_len, *self.k[layer].shape[1:])
        k_all, v_all = self.k[layer].view(shape), self.v[layer].view(shape)
        rows, n, ctx = batch.rows, len(batch.rows), batch.context_len
        if rows == list(range(rows[0], rows[0] + n)):    # neighbouring rows: a view, no copy
            return k_all[rows[0]: rows[0] + n, :ctx], v_all[rows[0]: rows[0] + n, :ctx]
        index = torch.tensor(rows, device=k_all.device)
        return k_all[index, :ctx], v_all[index, :ctx]
# --8<-- [end:kv-cache]


# --8<-- [start:batch]
@dataclass
class RaggedBatch:
    """What one forward pass computes: new tokens of several sequences, concatenated.

    Sequence i owns cache row rows[i], already holds starts[i] tokens there, and brings
    lengths[i] new ones (a prefill brings its prompt, a decode step brings 1).
    """

    token_ids: torch.Tensor      # [total_tokens]
    positions: torch.Tensor      # [total_tokens]: starts[i] + 0 .. lengths[i]-1 for each i
    slots: torch.Tensor          # [total_tokens]: where each new key/value is written
    rows: list[int]
    starts: list[int]
    lengths: list[int]

    @classmethod
    def build(cls, new_tokens: list[list[int]], rows: list[int], starts: list[int], max_len: int,
              device="cpu") -> RaggedBatch:
        lengths = [len(t) for t in new_tokens]
        if not lengths or min(lengths) < 1:
            raise ValueError("every sequence in a batch needs at least one new token")
        if any(s + n > max_len for s, n in zip(starts, lengths)):
            raise ValueError(f"a sequence would outgrow its KV cache region of {max_len} tokens")
        positions = [s + j for s, n in zip(starts, lengths) for j in range(n)]
        slots = [r * max_len + s + j for r, s, n in zip(rows, starts, lengths) for j in range(n)]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor([t for seq in new_tokens for t in seq]), as_tensor(positions),
                   as_tensor(slots), list(rows), list(starts), lengths)

    @property
    def context_len(self) -> int:
        """The longest context any sequence attends to after this step."""
        return max(s + n for s, n in zip(self.starts, self.lengths))

    # What attention needs to know about the layout is the same in every layer: computed once.
    @functools.cached_property
    def pad_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, offset) of every flat token inside the padded [seqs, q_len] rectangle."""
        seq = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))
        offset = torch.cat([torch.arange(n) for n in self.lengths])
        return seq.to(self.token_ids.device), offset.to(self.token_ids.device)

    @functools.cached_property
    def parts(self) -> list[tuple[slice, slice, RaggedBatch]]:
        """(rows, flat tokens, sub-batch) runs of decode rows (one new token) and prefill rows.

        Attention pads queries to the longest row, so a decode row next to a 200-token prefill
        chunk would cost 200 queries' work; attended apart, each run pads only to its own kind.
        A batch of one kind (every batch of Chapters 6 and 7) is a single part: itself.
        """
        kinds = [n == 1 for n in self.lengths]
        if len(set(kinds)) == 1:
            return [(slice(None), slice(None), self)]
        out, first, offsets = [], 0, [0, *itertools.accumulate(self.lengths)]
        for last in range(1, len(kinds) + 1):
            if last == len(kinds) or kinds[last] != kinds[first]:
                tokens = slice(offsets[first], offsets[last])
                out.append((slice(first, last), tokens, RaggedBatch(
                    self.token_ids[tokens], self.positions[tokens], self.slots[tokens], self.rows[first:last],
                    self.starts[first:last], self.lengths[first:last])))
                first = last
        return out

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[seqs, 1, q_len, ctx]: key j is visible to query i of a row iff j <= start + i.

        None when the rectangle is exact (equal starts and lengths): plain or causal attention.
        """
        n, q_len = len(self.lengths), max(self.lengths)
        if len(set(self.lengths)) == 1 and len(set(self.starts)) == 1 and (q_len == 1 or self.starts[0] == 0):
            return None
        device, ctx = self.token_ids.device, self.context_len
        starts = torch.tensor(self.starts, device=device).view(n, 1, 1)
        q_pos = starts + torch.arange(q_len, device=device).view(1, q_len, 1)
        return (torch.arange(ctx, device=device).view(1, 1, ctx) <= q_pos).unsqueeze(1)
# --8<-- [end:batch]
