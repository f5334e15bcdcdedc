"""Chapter 15: on one GPU the KV pool takes what gpu_memory_utilization leaves after the weights.

No GPU here: the device's memory is read through torch.cuda.mem_get_info, which the tests
replace, so the arithmetic and the refusals are checked; the sizes on a real GPU are not."""

from __future__ import annotations

import pytest
import torch

from minivllm import gpu_memory
from minivllm.config import EngineConfig
from minivllm.model import ModelConfig

GiB = 1 << 30
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def test_the_pool_gets_the_fraction_less_what_is_taken_and_the_headroom(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 140 * GiB))   # 40 GiB in use
    assert gpu_memory.kv_memory_left(torch.device("cuda"), 0.9, 2 * GiB) == int(140 * GiB * 0.9) - 40 * GiB - 2 * GiB
    assert gpu_memory.kv_memory_left(torch.device("cuda"), 0.5, 0) == 30 * GiB


def test_a_fraction_that_leaves_nothing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 80 * GiB))   # 70 GiB taken
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.8 leaves no room"):
        gpu_memory.kv_memory_left(torch.device("cuda"), 0.8, GiB)


def test_the_headroom_grows_with_the_largest_step():
    small = gpu_memory.step_headroom(SMOLLM2, 256, 32, torch.bfloat16)
    big = gpu_memory.step_headroom(SMOLLM2, 8192, 256, torch.bfloat16)
    assert gpu_memory.FIXED_HEADROOM < small < big
    # the logits of 32 sequences are in it: bf16 from the head, then two float32 copies
    assert small - gpu_memory.FIXED_HEADROOM > 32 * 49152 * (2 + 2 * 4)


def test_the_headroom_counts_prefill_activations_and_graph_memory_by_parts(monkeypatch):
    """Each part on its own, for SmolLM2 in bf16 at 32 sequences, 2048 tokens a step, 8192 a row;
    with graphs, one logits buffer (not one per bucket: 7 buckets up to 32 would hold 2.7 times as
    much) and their largest bucket's temporaries, which only the graphs may use."""
    eager = gpu_memory.headroom_parts(SMOLLM2, 2048, 32, torch.bfloat16, 8192)
    graphs = gpu_memory.headroom_parts(SMOLLM2, 2048, 32, torch.bfloat16, 8192, graphs=True)
    per_token = (4 * 576 + 3 * 1536 + (9 + 2 * 3) * 64) * 2
    assert eager["prefill activations"] == 2048 * per_token
    assert eager["gathered context"] == 32 * 8192 * 2 * 3 * 64 * 2           # keys and values of one layer
    assert eager["step logits"] == 32 * 49152 * (2 + 8)
    assert set(graphs) - set(eager) == {"graph logits buffer", "graph pool"}
    assert graphs["graph logits buffer"] == 32 * 49152 * 4
    from minivllm.cuda_graphs import buckets
    assert sum(buckets(32)) * 49152 * 4 > 2.7 * graphs["graph logits buffer"]
    assert graphs["graph pool"] > 32 * 49152 * 6
    assert gpu_memory.step_headroom(SMOLLM2, 2048, 32, torch.bfloat16, 8192, True) == sum(graphs.values())
    # on a replaced device the pool is smaller by exactly the graphs' parts
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 * GiB, 140 * GiB))
    left = [gpu_memory.kv_memory_left(torch.device("cuda"), 0.9, sum(p.values())) for p in (eager, graphs)]
    assert left[0] - left[1] == graphs["graph logits buffer"] + graphs["graph pool"]


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9"])
def test_the_fraction_is_checked_before_anything_loads(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
        EngineConfig(gpu_memory_utilization=bad)
    assert EngineConfig().gpu_memory_utilization == 0.9 and EngineConfig().kv_memory is None


def test_each_tensor_parallel_rank_sizes_its_pool_from_its_own_gpu(monkeypatch):
    """With several ranks, each sizes its pool from what its own GPU has left once its shard is in
    (the function is sent to every rank and called there), in blocks of its own KV heads: one rank
    of 2 here, holding 2 of 4 KV heads, gets twice the blocks one process would from the same bytes."""
    import dataclasses
    import functools

    from minivllm.collectives import Collectives
    from minivllm.model import LlamaModel
    from minivllm.parallel import rank_config, rank_pool

    whole = dataclasses.replace(SMOLLM2, num_layers=2, num_heads=8, num_kv_heads=4, max_position_embeddings=64)
    rank = LlamaModel(rank_config(whole, 2), {"embed": torch.empty(1, 1)})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GiB // 2, GiB))   # half in use
    left = functools.partial(gpu_memory.kv_memory_left, utilization=0.75, headroom=GiB // 8)
    pool = rank_pool(rank, left, 16, Collectives(0, 1, "cpu"))
    per_block = 16 * whole.kv_bytes_per_token(torch.float32) // 2               # 2 of the 4 KV heads
    assert pool.num_blocks == (GiB // 8) // per_block and rank.config.num_kv_heads == 2
    fixed = rank_pool(rank, 4 << 20, 16, Collectives(0, 1, "cpu"))             # on the CPU: kv_memory per rank
    assert fixed.num_blocks == (4 << 20) // per_block and fixed.nbytes == 4 << 20
