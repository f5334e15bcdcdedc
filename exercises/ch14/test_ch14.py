"""Chapter 14's exercises: the split's counts (minivllm/parallel.py) and a greedy all-gather."""

import torch

from harness import given
from minivllm import parallel
from minivllm.model import ModelConfig
from minivllm.model_files import DEFAULT_MODEL, resolve_model


def test_14_1_rank_counts(answers):
    measured = parallel.rank_counts(ModelConfig.from_folder(resolve_model(DEFAULT_MODEL)), 3)
    assert tuple(given(answers.RANK_COUNTS_3, "RANK_COUNTS_3")) == measured, f"the split gives {measured}"


def test_14_2_vocab_rows(answers):
    assert given(answers.VOCAB_ROWS_5, "VOCAB_ROWS_5") == parallel.vocab_rows(49152, 5)


def test_14_3_greedy_all_gather(answers):
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[2, 10] = logits[2, 900] = 99.0        # a tie across ranks: the lower id wins
    logits[3, 400] = logits[3, 401] = 99.0       # a tie inside one rank
    for size in (1, 2, 4, 5):
        per = parallel.vocab_rows(1000, size)
        shards = [(logits[:, r * per:(r + 1) * per], r * per) for r in range(size)]
        gathered = [answers.local_best(s, start) for s, start in shards]
        assert all(g.shape == (6, 2) for g in gathered), "two numbers per row, per rank"
        assert answers.pick(gathered) == logits.argmax(dim=-1).tolist(), f"{size} ranks"
