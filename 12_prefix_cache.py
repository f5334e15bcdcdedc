"""12_prefix_cache.py - Chapter 8: prefix caching. Compute a shared prompt prefix once.

The idea and the cache itself (block hashes, the cache table, eviction) are
minivllm/prefix_cache.py; this script walks it by hand on made-up blocks, no model.

    python 12_prefix_cache.py                    # a prefix cache walked by hand, no model
    python 12_prefix_cache_demo.py               # a shared system prompt, a conversation: TTFT on/off
    python 12_prefix_cache_demo.py --plot ch8.png
"""

from __future__ import annotations

from minivllm.prefix_cache import PrefixCachingBlockManager

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
