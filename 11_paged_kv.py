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

from minivllm.block_manager import BlockManager

# The pool and its batch live in minivllm/kv_cache.py, the block manager in minivllm/block_manager.py.


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
