"""Chapter 13's exercises: the matmuls a step runs, the paged decode attention, the fused glue."""

import torch

from harness import catches, patched, within
from minivllm import compile as compiled
from minivllm.batch import RaggedBatch
from minivllm.model import LlamaModel


def test_13_1_matmuls(answers, tiny_model_dir):
    model = LlamaModel.from_folder(tiny_model_dir)
    calls = []
    linear = model.linear
    model.linear = lambda x, name: calls.append(name) or linear(x, name)
    model.forward(RaggedBatch.build([[1, 2, 3]], [0], [0], 8), model.new_cache(1, 8))
    within(answers.MATMULS_PER_FORWARD, len(calls), what="MATMULS_PER_FORWARD")


def test_13_2_gathered_attention(answers):
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    k_pool, v_pool = torch.randn(10 * block_size, kv_heads, dim), torch.randn(10 * block_size, kv_heads, dim)
    tables = torch.tensor([[3, 7, 1], [0, 9, 0], [5, 2, 8]])
    lens = torch.tensor([10, 5, 12])
    q = torch.randn(3, heads, dim)
    expected = compiled.paged_decode_attention(q, k_pool, v_pool, tables, lens, block_size)
    assert torch.allclose(answers.gathered_decode_attention(q, k_pool, v_pool, tables, lens, block_size),
                          expected, atol=1e-5)


# --- the planted defect (read it after you have tried) ---------------------------------------
def halves_swapped(original):
    return lambda gate_up: original(torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1))


def test_13_3_find_the_bug(answers):
    catches(answers.check_silu_mul, lambda: patched("minivllm.compile:silu_mul", halves_swapped),
            lambda: compiled.silu_mul, what="check_silu_mul")
