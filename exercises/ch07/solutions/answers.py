"""Chapter 7 exercises: the paged KV cache (minivllm/block_manager.py) (solutions)."""

import math


# Exercise 7.1 (predict, then measure). A BlockManager of 16-token blocks allocates three
# sequences of 5, 16 and 17 tokens: how many blocks are in use? Tolerance: exact.
# why: ceil(5/16) + ceil(16/16) + ceil(17/16) = 1 + 1 + 2.
BLOCKS_IN_USE = 4


# Exercise 7.2 (predict, then measure). A fresh BlockManager(8, 16): sequence 0 allocates 16
# tokens, sequence 1 allocates 4, then sequence 0 appends 5 tokens (append_slot five times).
# What slot does the last append return? Tolerance: exact.
# why: seq 0 holds block 0, seq 1 block 1; token 16 of seq 0 needs a new block: 2. Token 20 is
# offset 4 in it: slot 2 x 16 + 4.
SLOT_OF_TOKEN_20 = 36


def can_admit(manager, num_tokens: int, watermark: float) -> bool:
    """Exercise 7.3 (extend): vLLM's watermark. Admit a new sequence of num_tokens only if, after
    taking its blocks, at least `watermark` of the pool (a fraction, rounded up to whole blocks)
    stays free for the running sequences' next tokens. Checked on many pool states."""
    reserve = math.ceil(watermark * manager.num_blocks)
    return manager.num_free - manager.blocks_for(num_tokens) >= reserve


def check_no_double_ownership(manager_class) -> None:
    """Exercise 7.4 (find the bug): raise AssertionError if a manager of this class ever hands one
    block to two sequences that share nothing. Called with the real BlockManager and with one
    that has a defect planted."""
    m = manager_class(6, 4)
    for seq in range(3):
        m.allocate(seq, 3)
    for _ in range(12):
        for seq in range(3):
            if m.num_free:
                m.append_slot(seq)
    owned = [b for table in m.tables.values() for b in table]
    assert len(owned) == len(set(owned)), f"a block has two owners: {m.tables}"
