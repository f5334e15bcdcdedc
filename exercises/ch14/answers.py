"""Chapter 14 exercises: tensor parallelism (minivllm/parallel.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch14
# (the shipped solutions are in solutions/answers.py: try first)

import torch


# Exercise 14.1 (predict, then measure). SmolLM2-135M (9 query heads, 3 KV heads, MLP 1536) on 3
# ranks: what does one rank hold (parallel.rank_counts: query heads, KV heads, MLP columns)?
# Tolerance: exact.
RANK_COUNTS_3 = None


# Exercise 14.2 (predict, then measure). The 49 152-row vocabulary on 5 ranks: how many rows does
# each rank's shard of the embedding and LM head have (parallel.vocab_rows)? Tolerance: exact.
VOCAB_ROWS_5 = None


def local_best(shard_logits: torch.Tensor, start: int) -> torch.Tensor:
    """Exercise 14.3 (extend): a greedy-only all-gather. Instead of gathering every rank's
    [rows, vocab / N] logits, each rank sends two numbers per row: its largest logit and that
    token's global id (its shard starts at token `start`). Returns [rows, 2] float32."""
    raise NotImplementedError


def pick(gathered: list[torch.Tensor]) -> list[int]:
    """... and every rank then picks the same greedy tokens from the N gathered [rows, 2] tensors,
    in rank order. Ties go to the lowest token id, as torch.argmax does. Checked against the
    argmax of the whole logits, ties included."""
    raise NotImplementedError
