"""Chapter 6 exercises: a model we own (minivllm/model.py, minivllm/batch.py) (solutions)."""

import torch


# Exercise 6.1 (predict, then measure). The tests' tiny model (tests/conftest.py: vocabulary
# 49152, hidden 64, MLP 128, 2 layers, 4 query heads and 2 KV heads of 16, tied embeddings):
# how many parameters does LlamaModel.num_parameters count? Tolerance: 1 %.
# why: embedding 49152 x 64 (the LM head is the same tensor); per layer q 64x64, k and v 64x32,
# o 64x64, gate, up and down 3 x 64x128, two norms of 64; one final norm.
TINY_PARAMETERS = 49152 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def greedy_ids(model, prompt_ids: list[int], n: int) -> list[int]:
    """Exercise 6.2 (extend): a greedy decode loop on our own model. Prefill the prompt with one
    RaggedBatch into a KV cache of one row (model.new_cache), then one decode step per token.
    Returns the n new token ids; checked token for token against HF's generate."""
    from minivllm.batch import RaggedBatch

    cache = model.new_cache(1, len(prompt_ids) + n)
    logits = model.forward(RaggedBatch.build([prompt_ids], [0], [0], cache.max_len), cache)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        position = len(prompt_ids) + len(out) - 1
        logits = model.forward(RaggedBatch.build([[out[-1]]], [0], [position], cache.max_len), cache)
        out.append(int(logits[-1].argmax()))
    return out


def check_against_hf(ours, hf, ids: list[int]) -> None:
    """Exercise 6.3 (find the bug): raise AssertionError if our LlamaModel's prefill logits for
    `ids` differ from HF's model (hf) by more than 1e-3. Called with the real model and with a
    defect planted in how positions become angles; the ids handed in are 60 tokens long."""
    from minivllm.batch import RaggedBatch

    cache = ours.new_cache(1, len(ids))
    mine = ours.forward(RaggedBatch.build([ids], [0], [0], len(ids)), cache, all_logits=True)
    theirs = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(mine, theirs, atol=1e-3), f"max difference {(mine - theirs).abs().max():.3g}"
