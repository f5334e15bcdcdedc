"""Chapter 6 exercises: a model we own (minivllm/model.py, minivllm/batch.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch06
# (the shipped solutions are in solutions/answers.py: try first)

import torch


# Exercise 6.1 (predict, then measure). The tests' tiny model (tests/conftest.py: vocabulary
# 49152, hidden 64, MLP 128, 2 layers, 4 query heads and 2 KV heads of 16, tied embeddings):
# how many parameters does LlamaModel.num_parameters count? Tolerance: 1 %.
TINY_PARAMETERS = None


def greedy_ids(model, prompt_ids: list[int], n: int) -> list[int]:
    """Exercise 6.2 (extend): a greedy decode loop on our own model. Prefill the prompt with one
    RaggedBatch into a KV cache of one row (model.new_cache), then one decode step per token.
    Returns the n new token ids; checked token for token against HF's generate."""
    raise NotImplementedError


def check_against_hf(ours, hf, ids: list[int]) -> None:
    """Exercise 6.3 (find the bug): raise AssertionError if our LlamaModel's prefill logits for
    `ids` differ from HF's model (hf) by more than 1e-3. Called with the real model and with a
    defect planted in how positions become angles; the ids handed in are 60 tokens long."""
    raise NotImplementedError
