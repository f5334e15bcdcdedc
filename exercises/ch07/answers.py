"""Chapter 7 exercises: the paged KV cache (minivllm/block_manager.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch07
# (the shipped solutions are in solutions/answers.py: try first)

import math


# Exercise 7.1 (predict, then measure). A BlockManager of 16-token blocks allocates three
# sequences of 5, 16 and 17 tokens: how many blocks are in use? Tolerance: exact.
BLOCKS_IN_USE = None


# Exercise 7.2 (predict, then measure). A fresh BlockManager(8, 16): sequence 0 allocates 16
# tokens, sequence 1 allocates 4, then sequence 0 appends 5 tokens (append_slot five times).
# What slot does the last append return? Tolerance: exact.
SLOT_OF_TOKEN_20 = None


def can_admit(manager, num_tokens: int, watermark: float) -> bool:
    """Exercise 7.3 (extend): vLLM's watermark. Admit a new sequence of num_tokens only if, after
    taking its blocks, at least `watermark` of the pool (a fraction, rounded up to whole blocks)
    stays free for the running sequences' next tokens. Checked on many pool states."""
    raise NotImplementedError


def check_no_double_ownership(manager_class) -> None:
    """Exercise 7.4 (find the bug): raise AssertionError if a manager of this class ever hands one
    block to two sequences that share nothing. Called with the real BlockManager and with one
    that has a defect planted."""
    raise NotImplementedError
