"""Chapter 16's exercises, on the real block manager, the engine's best_of rule and the real engine."""

import random
from types import SimpleNamespace

import pytest

from harness import catches, given, patched, within
from minivllm.block_manager import BlockManager


def forked(prompt_len: int, n: int, own_tokens: int, block_size: int = 16) -> BlockManager:
    """The engine's bookkeeping for n answers: the prompt's blocks, the fork, each answer's first write
    (the prompt's last token), then slots up to own_tokens tokens of its own."""
    bm = BlockManager(4096, block_size)
    bm.allocate_prompt(0, list(range(prompt_len)))
    for child in range(1, n):
        bm.fork(0, child)
    for seq in range(n):
        bm.own(seq, prompt_len - 1, prompt_len)
        while bm.lengths[seq] < prompt_len + own_tokens:
            bm.append_slot(seq)
    return bm


def test_16_1_blocks_held(answers):
    bm = forked(200, 8, 64)
    within(answers.BLOCKS_HELD, bm.num_blocks - bm.num_free, what="BLOCKS_HELD")


def test_16_2_blocks_copied(answers):
    within(answers.BLOCKS_COPIED, len(forked(33, 4, 0).take_copies()), what="BLOCKS_COPIED")


def test_16_3_pick_best_of(answers):
    from minivllm.many_answers import best

    rng = random.Random(0)
    for trial in range(50):
        lps = [[round(rng.uniform(-4, 0), 1) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(2, 8))]
        n = rng.randrange(1, len(lps) + 1)
        members = [SimpleNamespace(choice=i, logprobs=[SimpleNamespace(logprob=v) for v in row], new_ids=row,
                                   detok=SimpleNamespace(stopped=False)) for i, row in enumerate(lps)]
        expected = [m.choice for m in best(members, n)]
        got = given(answers.pick_best_of(lps, n), "pick_best_of")
        assert list(got) == expected, f"answers {lps}, n = {n}: expected {expected}, got {list(got)}"


# --- the planted defect (read it after you have tried) ---------------------------------------
@pytest.fixture(scope="module")
def case(tiny_model_dir):
    from minivllm import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, block_size=8)
    yield llm, "The quick brown fox jumps over the lazy dog, twice over."
    llm.close()


def fork_counts_twice(original):
    def fork(self, seq_id, child_id):
        table = original(self, seq_id, child_id)
        self.ref_counts[table[0]] += 1          # one reference too many: the first block is never freed
        return table
    return fork


def test_16_4_find_the_bug(answers, case):
    catches(answers.check_answers_give_back_their_blocks,
            lambda: patched("minivllm.block_manager:BlockManager.fork", fork_counts_twice), lambda: case,
            what="check_answers_give_back_their_blocks")
