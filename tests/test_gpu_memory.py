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
    # float32 logits of 32 sequences, twice, are in it: 12.6 MB for SmolLM2's vocabulary
    assert small - gpu_memory.FIXED_HEADROOM > 2 * 32 * 49152 * 4


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9"])
def test_the_fraction_is_checked_before_anything_loads(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
        EngineConfig(gpu_memory_utilization=bad)
    assert EngineConfig().gpu_memory_utilization == 0.9 and EngineConfig().kv_memory is None
