"""Chapter 13 exercises: compiled steps (minivllm/compile.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch13
# (the shipped solutions are in solutions/answers.py: try first)

import torch


# Exercise 13.1 (predict, then measure). One forward of our LlamaModel on the tests' tiny model
# (2 layers): how many times does it call LlamaModel.linear, the one place a matmul reads
# weights? Tolerance: exact. Everything between those matmuls is the glue Chapter 13 fuses.
MATMULS_PER_FORWARD = None


def gathered_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_size: int):
    """Exercise 13.2 (extend): the same answer as compile.paged_decode_attention, written the
    plain way: for each sequence, copy its first context_lens[i] keys and values out of the pools
    through its block table, then run ordinary attention (grouped-query: each KV head serves
    heads // kv_heads query heads). Returns [seqs, heads * head_dim]; checked within 1e-5."""
    raise NotImplementedError


def check_silu_mul(silu_mul) -> None:
    """Exercise 13.3 (find the bug): raise AssertionError if this fused silu_mul (the SwiGLU glue
    over the fused gate_up output: first half gate, second half up) is not SiLU(gate) * up.
    Called with the real one and with a defect planted."""
    raise NotImplementedError
