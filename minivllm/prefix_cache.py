"""Chapter 8: prefix caching. Compute a shared prompt prefix once.

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
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys

from minivllm.block_manager import BlockManager
from minivllm.kv_cache import PoolFullError

ROOT_HASH = 0   # the "parent" of a prompt's first block


# --8<-- [start:hash]
def root_hash(salt: str | None) -> int:
    """The parent of a prompt's first block: one for every unsalted prompt, another per salt, so
    equal text under different salts shares nothing (vLLM puts cache_salt in the first block's hash)."""
    return ROOT_HASH if salt is None else hash(("cache_salt", salt))


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
    root: int       # the prompt's root hash: its salt, checked too, so a collision never crosses salts
# --8<-- [end:hash]


# --8<-- [start:manager]
class PrefixCachingBlockManager(BlockManager):
    """Chapter 7's block manager, plus a table of full blocks that later prompts can reuse."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.by_hash: dict[int, int] = {}                  # prefix hash -> block holding its K/V
        self.content: dict[int, CachedBlock] = {}          # block -> what it holds (cached blocks only)
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.chains: dict[int, tuple[int, int, int]] = {}  # seq -> (blocks cached, last hash, last serial)
        self.roots: dict[int, int] = {}                    # seq -> its prompt's root hash (its salt)
        self._serials = itertools.count(1)
        self.prompt_tokens = self.hit_tokens = 0           # for the hit rate
        self.enabled = True   # off: Chapter 7's answers (for comparisons); what is cached stays cached

    @property
    def caches_prefixes(self) -> bool:
        return self.enabled

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

    def match(self, tokens: list[int], root: int = ROOT_HASH) -> tuple[list[int], int, int]:
        """The longest run of leading full blocks already cached: (blocks, last hash, last serial).

        Never the whole prompt: the block holding its last token is left to compute."""
        bs, found, h, serial = self.block_size, [], root, 0
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block = self.by_hash.get(block_hash(h, chunk))
            c = self.content.get(block)
            if c is None or c.tokens != chunk or c.parent != serial or c.root != root:   # a miss, or a collision
                break
            found.append(block)
            h, serial = c.hash, c.serial
        return found, h, serial

    def _need_and_room(self, hits: list[int], num_tokens: int) -> tuple[int, int]:
        """New blocks a prompt needs besides its cached prefix `hits`, and the blocks it may take:
        the free ones, less the hits nobody uses now (sharing them takes them off the evictable list)."""
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return self.blocks_for(num_tokens) - len(hits), self.num_free - revived

    def can_allocate_prompt(self, tokens: list[int], salt: str | None = None) -> bool:
        """Would allocate_prompt succeed now? A prompt whose prefix is cached needs blocks only for the rest."""
        if not self.enabled:
            return super().can_allocate_prompt(tokens)
        need, room = self._need_and_room(self.match(tokens, root_hash(salt))[0], len(tokens))
        return need <= room

    def allocate_prompt(self, seq_id: int, tokens: list[int], salt: str | None = None) -> int:
        """allocate() for a sequence whose tokens are known: share its cached prefix (cached under
        the same salt), take new blocks for the rest. Returns how many tokens already have their K/V."""
        if not self.enabled:
            return super().allocate_prompt(seq_id, tokens)
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not tokens:
            raise ValueError("cannot allocate a sequence of 0 tokens")
        root = root_hash(salt)
        hits, h, serial = self.match(tokens, root)
        need, room = self._need_and_room(hits, len(tokens))
        if need > room:
            raise PoolFullError(f"{need} blocks needed, {room} free of {self.num_blocks}")
        for block in hits:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        self.tables[seq_id] = hits + [self._take() for _ in range(need)]
        self.lengths[seq_id] = len(tokens)
        self.chains[seq_id] = (len(hits), h, serial)
        self.roots[seq_id] = root
        cached = len(hits) * self.block_size
        self.prompt_tokens, self.hit_tokens = self.prompt_tokens + len(tokens), self.hit_tokens + cached
        return cached

    def cache_computed(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence's first len(tokens) tokens now have K/V in its blocks: make every full
        block among them findable. Call it after the forward that wrote them, never before."""
        if not self.enabled:
            return
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} has no blocks (never allocated, or freed already)")
        if len(tokens) > self.lengths[seq_id]:
            raise ValueError(f"sequence {seq_id} holds slots for {self.lengths[seq_id]} tokens, not {len(tokens)}")
        root = self.roots.get(seq_id, ROOT_HASH)
        done, h, serial = self.chains.get(seq_id, (0, root, 0))
        table, bs = self.tables[seq_id], self.block_size
        for i in range(done, len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(h, chunk)
            known = self.content.get(self.by_hash.get(h))
            if known is None:                           # new content: this block holds it from now on
                known = self.content[table[i]] = CachedBlock(h, chunk, serial, next(self._serials), root)
                self.by_hash[h] = table[i]
            elif known.tokens != chunk or known.parent != serial or known.root != root:
                self.chains[seq_id] = (sys.maxsize, h, serial)   # a collision: cache no more of it
                return
            serial, done = known.serial, i + 1   # (a duplicate of a cached block: later ones link to that)
        self.chains[seq_id] = (done, h, serial)

    def fork(self, seq_id: int, child_id: int) -> list[int]:
        """Chapter 16: the child shares the parent's blocks and goes on caching where it left off."""
        table = super().fork(seq_id, child_id)
        for store in (self.chains, self.roots):
            if seq_id in store:
                store[child_id] = store[seq_id]
        return table

    def free(self, seq_id: int) -> None:
        """Blocks nobody uses go back; cached ones keep their K/V on the evictable list, the
        sequence's last blocks first in line (a prefix's root outlives its branches)."""
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} has no blocks (never allocated, or freed already)")
        for block in reversed(self.tables.pop(seq_id)):
            self._release(block)
        del self.lengths[seq_id]
        self.chains.pop(seq_id, None)
        self.roots.pop(seq_id, None)

    def _release(self, block: int) -> None:
        """One owner fewer; a cached block nobody owns keeps its K/V, evictable."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.content:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def reset(self) -> None:
        """Forget every cached block (vLLM's reset_prefix_cache), e.g. between two measurements;
        the on/off switch stays where it was. Only while no sequence holds blocks."""
        if self.tables:
            raise RuntimeError("cannot reset the prefix cache while requests hold blocks")
        enabled = self.enabled
        self.__init__(self.num_blocks, self.block_size)   # every table and count as it was when new
        self.enabled = enabled

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
# --8<-- [end:manager]
