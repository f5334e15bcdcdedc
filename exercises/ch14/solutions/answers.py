"""Chapter 14 exercises: tensor parallelism (minivllm/parallel.py) (solutions)."""

import torch


# Exercise 14.1 (predict, then measure). SmolLM2-135M (9 query heads, 3 KV heads, MLP 1536) on 3
# ranks: what does one rank hold (parallel.rank_counts: query heads, KV heads, MLP columns)?
# Tolerance: exact.
# why: Megatron splits heads and MLP columns evenly: 9 / 3, 3 / 3, 1536 / 3.
RANK_COUNTS_3 = (3, 1, 512)


# Exercise 14.2 (predict, then measure). The 49 152-row vocabulary on 5 ranks: how many rows does
# each rank's shard of the embedding and LM head have (parallel.vocab_rows)? Tolerance: exact.
# why: 49152 / 5 = 9830.4, rounded up so that every token has a home; the last shard is padded.
VOCAB_ROWS_5 = 9831


def local_best(shard_logits: torch.Tensor, start: int) -> torch.Tensor:
    """Exercise 14.3 (extend): a greedy-only all-gather. Instead of gathering every rank's
    [rows, vocab / N] logits, each rank sends two numbers per row: its largest logit and that
    token's global id (its shard starts at token `start`). Returns [rows, 2] float32."""
    values, index = shard_logits.float().max(dim=-1)
    return torch.stack([values, (index + start).float()], dim=-1)


def pick(gathered: list[torch.Tensor]) -> list[int]:
    """... and every rank then picks the same greedy tokens from the N gathered [rows, 2] tensors,
    in rank order. Ties go to the lowest token id, as torch.argmax does. Checked against the
    argmax of the whole logits, ties included."""
    stacked = torch.stack(gathered)                     # [ranks, rows, 2]
    best = stacked[..., 0].max(dim=0).values            # [rows]
    ids = torch.where(stacked[..., 0] == best, stacked[..., 1], torch.inf).min(dim=0).values
    return [int(i) for i in ids]
