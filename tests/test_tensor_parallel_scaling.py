"""Chapter 14's scaling model on paper: the shapes it prices are the engine's.

Parameters count a tied embedding once (SmolLM2's real 134.5 M, not 163 M), and a size is
priced only where parallel.check_size accepts it (one definition of which N split a model).
"""

from __future__ import annotations

from conftest import load_script

scaling = load_script("18_tensor_parallel_scaling")
SMOL, LLAMA_8B, LLAMA_70B = scaling.MODELS


def test_a_tied_lm_head_is_counted_once():
    assert SMOL.tied and not LLAMA_8B.tied and not LLAMA_70B.tied
    assert abs(SMOL.params - 134.5e6) < 0.1e6                # config.json's model: 134,515,008 with its norms
    assert abs(LLAMA_8B.params - 8.03e9) < 0.01e9            # untied: embedding and LM head both counted


def test_only_the_sizes_the_engine_accepts_are_priced():
    assert [n for n in range(1, 17) if SMOL.splits(n)] == [1, 3]          # 9 heads, 1,536 MLP columns
    assert LLAMA_70B.splits(16) and not LLAMA_70B.splits(3)               # 8 KV heads copied to 2 ranks each
    step = scaling.step_s(SMOL, 2, *scaling.LINKS["NVLink"])
    assert not step["splits"]
    results = scaling.table(1, 1024)
    assert [s["splits"] for s in results[(SMOL.name, "NVLink")]] == [n in (1, 3) for n in scaling.SIZES]
