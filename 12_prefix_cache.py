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

    python 12_prefix_cache.py                    # a prefix cache walked by hand, no model
    python 12_prefix_cache_demo.py               # a shared system prompt, a conversation: TTFT on/off
    python 12_prefix_cache_demo.py --plot ch8.png
"""

from __future__ import annotations

from minivllm.prefix_cache import ROOT_HASH, CachedBlock, PrefixCachingBlockManager, block_hash  # noqa: F401

# The cache itself (block hashes, the caching block manager): minivllm/prefix_cache.py


def main() -> None:
    """A prefix cache walked by hand: two prompts that share a system prompt, no model."""
    import argparse

    parser = argparse.ArgumentParser(description="Chapter 8: a prefix cache by hand. "
                                                 "On the model, with TTFT: python 12_prefix_cache_demo.py")
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()
    bs = args.block_size
    blocks = PrefixCachingBlockManager(num_blocks=16, block_size=bs)
    system = list(range(100, 100 + 3 * bs))               # three blocks' worth of shared system prompt
    first, second = system + [1, 2, 3], system + [7, 8]
    print(f"[block size {bs}; both prompts start with the same {len(system)} tokens]")
    cached = blocks.allocate_prompt(0, first)
    print(f"  prompt 1 ({len(first)} tokens): {cached} cached; blocks {blocks.tables[0]}")
    blocks.cache_computed(0, first)                        # after its prefill: its full blocks are findable
    print(f"  after its prefill, cached blocks: {sorted(blocks.content)}")
    cached = blocks.allocate_prompt(1, second)
    print(f"  prompt 2 ({len(second)} tokens): {cached} cached; blocks {blocks.tables[1]} "
          f"(shares {len(set(blocks.tables[0]) & set(blocks.tables[1]))} blocks)")
    blocks.free(0)
    blocks.free(1)
    print(f"  both finished: {blocks.num_free} of 16 blocks free; {len(blocks.evictable)} keep their K/V for "
          f"the next prompt (evictable); hit rate {blocks.hit_rate:.0%}")


if __name__ == "__main__":
    main()
