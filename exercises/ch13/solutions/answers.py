"""Chapter 13 exercises: compiled steps (minivllm/compile.py) (solutions)."""

import torch


# Exercise 13.1 (predict, then measure). One forward of our LlamaModel on the tests' tiny model
# (2 layers): how many times does it call LlamaModel.linear, the one place a matmul reads
# weights? Tolerance: exact. Everything between those matmuls is the glue Chapter 13 fuses.
# why: per layer the fused qkv, o, the fused gate_up and down (4), times 2 layers, plus the LM head.
MATMULS_PER_FORWARD = 2 * 4 + 1


def gathered_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_size: int):
    """Exercise 13.2 (extend): the same answer as compile.paged_decode_attention, written the
    plain way: for each sequence, copy its first context_lens[i] keys and values out of the pools
    through its block table, then run ordinary attention (grouped-query: each KV head serves
    heads // kv_heads query heads). Returns [seqs, heads * head_dim]; checked within 1e-5."""
    n, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    out = []
    for i in range(n):
        t = torch.arange(int(context_lens[i]))
        slots = block_tables[i, t // block_size] * block_size + t % block_size
        k = k_pool[slots].repeat_interleave(heads // kv_heads, dim=1)      # [ctx, heads, dim]
        v = v_pool[slots].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.einsum("hd,chd->hc", q[i], k).mul(dim ** -0.5).softmax(dim=-1)
        out.append(torch.einsum("hc,chd->hd", weights, v).reshape(heads * dim))
    return torch.stack(out)


def check_silu_mul(silu_mul) -> None:
    """Exercise 13.3 (find the bug): raise AssertionError if this fused silu_mul (the SwiGLU glue
    over the fused gate_up output: first half gate, second half up) is not SiLU(gate) * up.
    Called with the real one and with a defect planted."""
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.allclose(silu_mul(torch.cat([gate, up], dim=-1)), expected), "not SiLU(gate) * up"
