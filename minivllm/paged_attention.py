"""Chapter 15: paged decode attention as one GPU kernel (Triton).

A decode row brings one new query token and attends to every key its sequence has cached.
Chapter 7 copied each row's blocks into one rectangle and called SDPA; Chapter 13 read them in
place on the CPU, in C++ (and as plain torch for the compiler to fuse). Here the loop is written
for the GPU, as vLLM's and nano-vllm's kernels are: one program per (decode row, KV head) walks
the row's block table and reads each key and value where it lies in the KV pool, keeping a
running softmax (the "online" softmax of FlashAttention), so no copy is made and nothing waits
on the host.

Everything the kernel needs comes as device tensors of fixed shapes: block tables padded to one
width, context lengths as a tensor. A CUDA graph (minivllm/cuda_graphs.py) can then record the
launch once and replay it with other rows, other lengths, other blocks.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from minivllm.kv_cache import KVPool, PagedBatch

tl = None   # triton.language: Triton is imported on first use (see jitted), and only then

TILE = 16   # keys read per loop iteration: a few vectors' worth, whatever the block size


# --8<-- [start:kernel]
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                        stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_table, stride_out_row,
                        scale, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE: tl.constexpr):
    """One program: decode row `row`, KV head `kv_head`, and the GROUP query heads that share it
    (grouped-query attention: each key is read once for the whole group)."""
    row, kv_head = tl.program_id(0), tl.program_id(1)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, DIM_PAD)     # padded to powers of two, masked
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g                                # query heads h*G .. h*G+G-1 share KV head h
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    context_len = tl.load(lens_ptr + row)                      # read on the device: no host sync
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)     # running max of the scores
    total = tl.zeros([GROUP_PAD], tl.float32)                  # running sum of exp(score - best)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)           # running sum of exp(...) * value
    for first in range(0, context_len, TILE):
        t = first + tl.arange(0, TILE)                         # token positions of this tile
        valid = t < context_len
        # The block table: token t lives in block table[t // BLOCK_SIZE], offset t % BLOCK_SIZE.
        block = tl.load(tables_ptr + row * stride_table + t // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
        where = slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :]
        ok = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + where, mask=ok, other=0.0).to(tl.float32)    # [TILE, DIM_PAD], in place
        v = tl.load(v_ptr + where, mask=ok, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale   # [GROUP_PAD, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Online softmax: a larger maximum rescales what was summed so far by exp(old - new).
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_out_row + heads[:, None] * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
# --8<-- [end:kernel]


# --8<-- [start:split-kernel]
def split_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, best_ptr, total_ptr, acc_ptr,
                        stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_table,
                        scale, SPLITS: tl.constexpr, PARTITION: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        DIM_PAD: tl.constexpr, TILE: tl.constexpr):
    """Flash-decoding: program (row, KV head, split) runs the same online softmax over tokens
    [split * PARTITION, (split + 1) * PARTITION) of the row's context only, and leaves its three
    partial results (running max, sum, unnormalised output) for `combine_splits`. A split past the
    row's context leaves max -inf, sum 0: it weighs nothing when the splits are combined."""
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, DIM_PAD)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    context_len = tl.load(lens_ptr + row)
    start = split * PARTITION
    end = tl.minimum(start + PARTITION, context_len)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for first in range(start, end, TILE):
        t = first + tl.arange(0, TILE)
        valid = t < end
        block = tl.load(tables_ptr + row * stride_table + t // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
        where = slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :]
        ok = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + where, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + where, mask=ok, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    part = (row * GROUP * tl.num_programs(1) + heads) * SPLITS + split      # [rows, heads, SPLITS]
    tl.store(best_ptr + part, best, mask=g_ok)
    tl.store(total_ptr + part, total, mask=g_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
# --8<-- [end:split-kernel]


# --8<-- [start:combine]
def combine_splits(best: torch.Tensor, total: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The reduction: each split's sums rescaled to the largest maximum of all splits, as the
    online softmax rescales within one. best, total [rows, heads, splits]; acc [..., head_dim].
    Split 0 always holds a token (a context is at least 1), so the maximum is finite. Plain torch
    on the device: a few launches, no host sync, recordable in a graph."""
    weight = torch.exp(best - best.amax(dim=-1, keepdim=True))            # 0 for an empty split
    return (weight[..., None] * acc).sum(dim=2) / (weight * total).sum(dim=-1)[..., None]
# --8<-- [end:combine]


def has_triton() -> bool:
    """Whether Triton is installed (the GPU image has it; the CPU engine never needs it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def jitted():
    """The kernel, handed to Triton on first use rather than at import. Triton decides when it is
    imported whether its kernels compile for the GPU or run in its interpreter on the CPU
    (TRITON_INTERPRET=1, how the tests run it): importing it late lets a test or a script choose
    after the engine is imported."""
    global tl
    import triton
    import triton.language
    tl = triton.language     # the name the kernels' bodies read
    return triton.jit(paged_decode_kernel), triton.jit(split_decode_kernel)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# --8<-- [start:launch]
PARTITION = 256   # tokens a split reads: vLLM's v2 kernel uses 512

# Fewer programs than this leave most of a GPU idle (an H100 has 132 SMs): then split the context.
# A guess from the SM count, not a measurement: no GPU has run this kernel yet.
SPLIT_BELOW = 512


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, split: bool | None = None,
                 partition: int = PARTITION) -> torch.Tensor:
    """Attention of one query token per row: q [rows, heads, head_dim] against the keys and values
    of pools [blocks * block_size, kv_heads, head_dim], row i's tokens 0 .. context_lens[i] - 1
    found through block_tables[i]. Returns [rows, heads * head_dim], like Chapter 6's attend.

    One pass: (rows x KV heads) programs, each over a whole context. Split (flash-decoding, the
    default when the one pass would have few programs): (rows x KV heads x splits) programs, the
    splits as many as the block tables' width allows, then `combine_splits`. Either way the shapes
    depend only on the batch size, the model and the tables' width, never on the lengths, so a
    CUDA graph can record it."""
    if not has_triton():
        raise RuntimeError("paged_decode needs Triton (pip install triton)")
    rows, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape != v_pool.shape or k_pool.stride(2) != 1 or q.stride(2) != 1 \
            or block_tables.stride(1) != 1:
        raise ValueError(f"paged_decode: {heads} query heads over {kv_heads} KV heads, pools "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}; each innermost dimension must be contiguous")
    if partition % TILE:
        raise ValueError(f"paged_decode: a partition of {partition} tokens is not a multiple of {TILE}")
    group = heads // kv_heads
    one_pass, split_pass = jitted()
    shapes = dict(BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=next_power_of_2(group), HEAD_DIM=head_dim,
                  DIM_PAD=next_power_of_2(head_dim), TILE=TILE)
    splits = -(-block_tables.shape[1] * block_size // partition)
    if split is None:
        split = rows * kv_heads < SPLIT_BELOW and splits > 1
    if not split:
        out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
        one_pass[(rows, kv_heads)](
            q, k_pool, v_pool, block_tables, context_lens, out,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0), out.stride(0),
            head_dim ** -0.5, **shapes)
        return out.view(rows, heads * head_dim)
    best = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(best)
    acc = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    split_pass[(rows, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, context_lens, best, total, acc,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0),
        head_dim ** -0.5, SPLITS=splits, PARTITION=partition, **shapes)
    return combine_splits(best, total, acc).to(q.dtype).reshape(rows, heads * head_dim)
# --8<-- [end:launch]


# --8<-- [start:reference]
def decode_rows(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> PagedBatch:
    """Decode rows as Chapter 7's batch, for reading the pool only: row i's new token sits at
    position context_lens[i] - 1. Its tables are cut to the blocks the longest row covers."""
    lens = context_lens.tolist()   # the host reads the lengths: fine for a reference, not for a graph
    width = -(-max(lens) // block_size)
    positions = context_lens.long() - 1
    # token ids and slots are never read when only reading the pool: the positions stand in
    return PagedBatch(positions, positions, positions, list(range(len(lens))), [n - 1 for n in lens],
                      [1] * len(lens), block_tables[:, :width].long().contiguous())


def reference_decode(q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor:
    """What paged_decode computes, the Chapter 7 way: gather each row's blocks into a rectangle
    (KVPool.context), mask what lies past each row's context, one SDPA. [rows, heads * head_dim]."""
    rows = decode_rows(block_tables, context_lens, pool.block_size)
    k, v = pool.context(layer, rows)                             # [rows, ctx, kv_heads, head_dim]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=rows.mask, enable_gqa=q.shape[1] != k.shape[2])
    return out.reshape(q.shape[0], -1)
# --8<-- [end:reference]
