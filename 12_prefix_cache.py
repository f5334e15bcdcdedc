"""12_prefix_cache.py - Chapter 8: prefix caching. Compute a shared prompt prefix once.

Real traffic repeats itself. Every request of a chat app starts with the same system
prompt; every turn of a conversation resends the whole history. With a paged KV cache
(Chapter 7) the keys and values in a *full* block depend only on the tokens before and
in that block, so a block computed for one request is valid for any later request whose
prompt starts with the same tokens. vLLM finds such blocks by hash:

    block hash      hash(parent block's hash, this block's token ids): one number that
                    stands for the whole prefix up to the end of the block
    cache table     hash -> the pool block holding that prefix's K/V
    a new request   walks its prompt block by block, shares every block it finds
                    (reference count + 1) and computes only the rest; the last prompt
                    token is always computed, because its logits are the first output
    eviction        a cached block nobody uses keeps its K/V on an evictable list and is
                    refilled (least recently used first) only when the free list is empty

A hit compares the stored token ids too, so a hash collision costs a miss, never a wrong
answer. Shared blocks are full and never written again; the partial last block of every
sequence is its own. The engine reports how many prompt tokens came from the cache
(`cached_tokens`, as OpenAI's usage does).

    python 12_prefix_cache.py               # a shared system prompt, a conversation: TTFT on/off
    python 12_prefix_cache.py --plot ch8.png
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import itertools
import sys

import torch

decode_loop = importlib.import_module("07_decode_loop")
paged = importlib.import_module("11_paged_kv")

ROOT_HASH = 0   # the "parent" of a prompt's first block


# --8<-- [start:hash]
def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """One number for a whole prefix: the parent's hash already stands for every earlier token.

    Python's tuple hash of ints is deterministic and 64 bits wide. Collisions are possible
    (vLLM now hashes with SHA-256 or xxHash to make them rare); ours are caught by `CachedBlock`.
    """
    return hash((parent_hash, tokens))


@dataclasses.dataclass(frozen=True)
class CachedBlock:
    """What a cached block holds, checked on every hit: its tokens, and which cached content
    came before it. Serial numbers are never reused, so a parent that was evicted and refilled
    since is not mistaken for the one this block was computed after."""

    hash: int
    tokens: tuple[int, ...]
    parent: int     # serial of the previous block's content (0: the block starts the prompt)
    serial: int
# --8<-- [end:hash]


# --8<-- [start:manager]
class PrefixCachingBlockManager(paged.BlockManager):
    """Chapter 7's block manager, plus a table of full blocks that later prompts can reuse."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.by_hash: dict[int, int] = {}                  # prefix hash -> block holding its K/V
        self.content: dict[int, CachedBlock] = {}          # block -> what it holds (cached blocks only)
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.chains: dict[int, tuple[int, int, int]] = {}  # seq -> (blocks cached, last hash, last serial)
        self._serials = itertools.count(1)
        self.prompt_tokens = self.hit_tokens = 0           # for the hit rate

    @property
    def num_free(self) -> int:
        """Blocks a new token may take: the free ones, and cached ones nobody uses right now."""
        return len(self.free_blocks) + len(self.evictable)

    def _take(self) -> int:
        if not self.free_blocks and self.evictable:      # only now give up cached content
            block, _ = self.evictable.popitem(last=False)  # the least recently used
            self._forget(block)
            self.free_blocks.append(block)
        return super()._take()

    def _forget(self, block: int) -> None:
        c = self.content.pop(block)
        if self.by_hash.get(c.hash) == block:
            del self.by_hash[c.hash]

    def match(self, tokens: list[int]) -> tuple[list[int], int, int]:
        """The longest run of leading full blocks already cached: (blocks, last hash, last serial).

        Never the whole prompt: the block holding its last token is left to compute."""
        bs, found, h, serial = self.block_size, [], ROOT_HASH, 0
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block = self.by_hash.get(block_hash(h, chunk))
            c = self.content.get(block)
            if c is None or c.tokens != chunk or c.parent != serial:   # a miss, or a collision
                break
            found.append(block)
            h, serial = c.hash, c.serial
        return found, h, serial

    def allocate_cached(self, seq_id: int, tokens: list[int]) -> int:
        """allocate() for a sequence whose tokens are known: share its cached prefix, take new
        blocks for the rest. Returns how many tokens already have their K/V in the pool."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not tokens:
            raise ValueError("cannot allocate a sequence of 0 tokens")
        hits, h, serial = self.match(tokens)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)   # they leave the evictable list
        need = self.blocks_for(len(tokens)) - len(hits)
        if need > self.num_free - revived:
            raise paged.PoolFullError(f"{need} blocks needed, {self.num_free - revived} free of {self.num_blocks}")
        for block in hits:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        self.tables[seq_id] = hits + [self._take() for _ in range(need)]
        self.lengths[seq_id] = len(tokens)
        self.chains[seq_id] = (len(hits), h, serial)
        cached = len(hits) * self.block_size
        self.prompt_tokens, self.hit_tokens = self.prompt_tokens + len(tokens), self.hit_tokens + cached
        return cached

    def cache_computed(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence's first len(tokens) tokens now have K/V in its blocks: make every full
        block among them findable. Call it after the forward that wrote them, never before."""
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} has no blocks (never allocated, or freed already)")
        if len(tokens) > self.lengths[seq_id]:
            raise ValueError(f"sequence {seq_id} holds slots for {self.lengths[seq_id]} tokens, not {len(tokens)}")
        done, h, serial = self.chains.get(seq_id, (0, ROOT_HASH, 0))
        table, bs = self.tables[seq_id], self.block_size
        for i in range(done, len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(h, chunk)
            known = self.content.get(self.by_hash.get(h))
            if known is None:                           # new content: this block holds it from now on
                known = self.content[table[i]] = CachedBlock(h, chunk, serial, next(self._serials))
                self.by_hash[h] = table[i]
            elif known.tokens != chunk or known.parent != serial:
                self.chains[seq_id] = (sys.maxsize, h, serial)   # a collision: cache no more of it
                return
            serial, done = known.serial, i + 1   # (a duplicate of a cached block: later ones link to that)
        self.chains[seq_id] = (done, h, serial)

    def free(self, seq_id: int) -> None:
        """Blocks nobody uses go back; cached ones keep their K/V on the evictable list, the
        sequence's last blocks first in line (a prefix's root outlives its branches)."""
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} has no blocks (never allocated, or freed already)")
        for block in reversed(self.tables.pop(seq_id)):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.content:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        del self.lengths[seq_id]
        self.chains.pop(seq_id, None)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
# --8<-- [end:manager]


@dataclasses.dataclass
class CachedSequence(decode_loop.Sequence):
    cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache


class PrefixCachingEngine(paged.PagedEngine):
    """Chapter 7's engine; a prompt's cached prefix is shared, not recomputed."""

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 32,
                 kv_memory: int = paged.DEFAULT_KV_MEMORY, block_size: int = paged.DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True):
        super().__init__(model_name, device, dtype, max_batch_size, kv_memory, block_size)
        self.blocks = PrefixCachingBlockManager(self.pool.num_blocks, block_size)
        self.prefix_caching = prefix_caching     # off: Chapter 7's behaviour, for comparisons

    def new_sequence(self, *args, **kwargs) -> CachedSequence:
        s = super().new_sequence(*args, **kwargs)
        return CachedSequence(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})

    def result(self, seq: CachedSequence, t0: float):
        res = super().result(seq, t0)
        res.metrics.cached_tokens = seq.cached_tokens
        return res

    # --8<-- [start:run]
    # Chapter 7's loop (PagedEngine.run) is unchanged; two of its hooks change what it does.
    def admit(self, seq_id: int, prompt: list[int], seq: CachedSequence) -> int:
        """The prefill starts after the prompt's cached prefix: those blocks are shared, not computed."""
        if not self.prefix_caching:
            return super().admit(seq_id, prompt, seq)
        seq.cached_tokens = self.blocks.allocate_cached(seq_id, prompt)
        return seq.cached_tokens

    def computed(self, ids: list[int], prompts: list[list[int]], seqs: list[CachedSequence],
                 live: list[int]) -> None:
        """After every forward, the blocks that became full are published to the cache."""
        if self.prefix_caching:
            for i in live:
                self.blocks.cache_computed(ids[i], prompts[i] + seqs[i].new_ids)
    # --8<-- [end:run]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM has the same call), e.g. between two measurements."""
        if self.blocks.tables:
            raise RuntimeError("cannot reset the prefix cache while requests hold blocks")
        self.blocks = PrefixCachingBlockManager(self.pool.num_blocks, self.pool.block_size)

    def stats(self) -> dict:
        b = self.blocks
        return {**super().stats(), "prefix_cache_hit_rate": round(b.hit_rate, 4),
                "prefix_cache_blocks": len(b.content), "kv_blocks_evictable": len(b.evictable)}


def __getattr__(name: str):
    if name == "main":   # the demonstration lives next door, to keep this file the chapter's core
        return importlib.import_module("12_prefix_cache_demo").main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    importlib.import_module("12_prefix_cache_demo").main()
