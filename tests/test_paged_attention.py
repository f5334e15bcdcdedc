"""Chapter 15: the Triton paged-decode kernel computes what Chapter 7's gather + SDPA computes.

The kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is first used),
on ragged rows whose blocks are shuffled through the pool, for several head layouts, in float32
and bfloat16. Skipped where Triton is not installed.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel is first jitted

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kv_cache import KVPool  # noqa: E402
from minivllm.paged_attention import paged_decode, reference_decode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ragged_pool(heads, kv_heads, dim, block_size, lens, dtype=torch.float32, width=6, seed=0):
    """A one-layer pool with random keys, and rows of the given context lengths whose blocks are
    a shuffle of the pool's, each table padded to `width` with blocks of other rows."""
    torch.manual_seed(seed)
    config = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    pool = KVPool(config, num_blocks=len(lens) * width, block_size=block_size, dtype=dtype)
    pool.k[0].copy_(torch.randn(pool.k[0].shape))
    pool.v[0].copy_(torch.randn(pool.v[0].shape))
    tables = torch.randperm(pool.num_blocks).view(len(lens), width)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    return pool, tables, torch.tensor(lens, dtype=torch.int32), q


LAYOUTS = [(4, 2, 16), (8, 8, 32), (6, 1, 24), (12, 4, 64)]   # (heads, KV heads, head_dim)


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 4])
def test_kernel_matches_gather_and_sdpa_float32(heads, kv_heads, dim, block_size):
    lens = [1, block_size, block_size + 1, 3 * block_size - 2, 6 * block_size, 17]
    pool, tables, context_lens, q = ragged_pool(heads, kv_heads, dim, block_size, lens)
    out = paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, block_size)
    torch.testing.assert_close(out, reference_decode(q, pool, 0, tables, context_lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS[:2])
def test_kernel_matches_in_bfloat16(heads, kv_heads, dim):
    lens = [5, 16, 33, 70, 96, 2]
    pool, tables, context_lens, q = ragged_pool(heads, kv_heads, dim, 16, lens, torch.bfloat16)
    out = paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, 16)
    expected = reference_decode(q.float(), as_float32(pool), 0, tables, context_lens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def as_float32(pool: KVPool) -> KVPool:
    """A copy of a one-layer pool in float32: the same numbers, the reference's precision."""
    config = SimpleNamespace(num_layers=1, num_kv_heads=pool.k[0].shape[1], head_dim=pool.k[0].shape[2])
    copy = KVPool(config, pool.num_blocks, pool.block_size)
    copy.k[0].copy_(pool.k[0])
    copy.v[0].copy_(pool.v[0])
    return copy


def test_kernel_reads_nothing_past_a_rows_context():
    """Every slot no row may read is set to NaN after the reference ran: the padded entries of
    the block tables and the tail of each row's last block. One NaN read would poison the row."""
    block_size, lens = 4, [1, 6, 9, 12]
    pool, tables, context_lens, q = ragged_pool(4, 2, 8, block_size, lens, width=5)
    expected = reference_decode(q, pool, 0, tables, context_lens)
    readable = torch.zeros(pool.num_blocks * block_size, dtype=torch.bool)
    for row, n in enumerate(lens):
        for t in range(n):
            readable[tables[row, t // block_size] * block_size + t % block_size] = True
    pool.k[0][~readable] = float("nan")
    pool.v[0][~readable] = float("nan")
    out = paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, block_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_is_attention_row_by_row():
    """The reference itself, against softmax(q·k / sqrt(d)) · v written out for each row and head."""
    block_size, lens = 4, [3, 10, 7]
    pool, tables, context_lens, q = ragged_pool(6, 2, 8, block_size, lens, width=3)
    out = reference_decode(q, pool, 0, tables, context_lens).view(3, 6, 8)
    for row, n in enumerate(lens):
        slots = [tables[row, t // block_size] * block_size + t % block_size for t in range(n)]
        for h in range(6):
            k, v = pool.k[0][slots, h // 3], pool.v[0][slots, h // 3]   # 3 query heads per KV head
            weights = torch.softmax(k @ q[row, h] / 8 ** 0.5, dim=0)
            torch.testing.assert_close(out[row, h], weights @ v, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_heads_that_do_not_share_evenly():
    pool, tables, context_lens, _ = ragged_pool(4, 2, 8, 4, [3, 5])
    with pytest.raises(ValueError, match="3 query heads over 2 KV heads"):
        paged_decode(torch.randn(2, 3, 8), pool.k[0], pool.v[0], tables, context_lens, 4)


def as_float64(pool: KVPool) -> KVPool:
    config = SimpleNamespace(num_layers=1, num_kv_heads=pool.k[0].shape[1], head_dim=pool.k[0].shape[2])
    copy = KVPool(config, pool.num_blocks, pool.block_size, torch.float64)
    copy.k[0].copy_(pool.k[0])
    copy.v[0].copy_(pool.v[0])
    return copy


def test_split_context_kernel_against_float64():
    """Flash-decoding: the context split into partitions of 32 tokens over programs, then combined.
    Against an fp64 gather + SDPA, 3 query heads to a KV head (as SmolLM2, a group padded to 4):
    a context of 1 (every split but the first empty), each side of a block boundary, exactly one
    partition, one token past it, and a long row over 4 partitions."""
    block_size, width = 16, 7                                        # 112 tokens a row: 4 partitions
    lens = [1, 15, 16, 17, 32, 33, 100]
    pool, tables, context_lens, q = ragged_pool(6, 2, 32, block_size, lens, width=width)
    split = paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, block_size, split=True, partition=32)
    exact = reference_decode(q.double(), as_float64(pool), 0, tables, context_lens)
    assert split.dtype == torch.float32 and (split.double() - exact).abs().max() < 1e-5


def test_split_kernel_reads_nothing_past_a_rows_context_and_splits_by_default_when_few_programs():
    """NaN in every slot no row may read, as above, through the split kernel; and a batch of a few
    rows, whose one pass would leave a GPU mostly idle, is split without being asked."""
    import minivllm.paged_attention as pa
    block_size, lens = 4, [1, 6, 17, 20]
    pool, tables, context_lens, q = ragged_pool(4, 2, 8, block_size, lens, width=5)
    expected = reference_decode(q, pool, 0, tables, context_lens)
    readable = torch.zeros(pool.num_blocks * block_size, dtype=torch.bool)
    for row, n in enumerate(lens):
        for t in range(n):
            readable[tables[row, t // block_size] * block_size + t % block_size] = True
    pool.k[0][~readable] = float("nan")
    pool.v[0][~readable] = float("nan")
    calls = []
    real = pa.combine_splits
    pa.combine_splits = lambda *a: calls.append(1) or real(*a)
    try:
        out = paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, block_size, partition=16)
    finally:
        pa.combine_splits = real
    assert calls == [1]                                              # 4 rows x 2 KV heads: split
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, block_size, partition=24)
