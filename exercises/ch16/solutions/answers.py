"""Chapter 16 exercises: many answers from one prompt (minivllm/many_answers.py, the block manager's fork) (solutions)."""

from minivllm import SamplingParams

# Exercise 16.1. Each sequence of 264 tokens spans ceil(264 / 16) = 17 blocks. The prompt's first
# 12 blocks are full (192 tokens) and stay shared by all eight; its 13th holds 8 prompt tokens and
# is written by every answer (the prompt's last token), so seven get a copy and the last keeps the
# original. Each answer owns 17 - 12 = 5 blocks: 12 + 8 x 5 = 52, where eight separate requests
# would hold 8 x 17 = 136.
BLOCKS_HELD = 52


# Exercise 16.2. 33 tokens take three blocks, and the prompt's last token (position 32) is the
# first of the third block: the block every answer writes into first holds nothing yet, so each
# takes a fresh block and none is copied. Copies are for a block with earlier tokens in it.
BLOCKS_COPIED = 0


def pick_best_of(answers: list[list[float]], n: int) -> list[int]:
    """The mean per token, as OpenAI documents best_of; sorted by (-mean, index) so ties keep order."""
    mean = [sum(lps) / max(len(lps), 1) for lps in answers]
    return sorted(range(len(answers)), key=lambda i: (-mean[i], i))[:n]


def check_answers_give_back_their_blocks(case) -> None:
    """After the request, no block may be referenced: a fork that counts a reference twice, or an
    answer never freed, leaves blocks held that nothing will ever give back."""
    llm, prompt = case
    llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True))
    blocks = llm.blocks
    assert not blocks.tables, f"sequences still hold blocks: {sorted(blocks.tables)}"
    held = [b for b, count in enumerate(blocks.ref_counts) if count]
    assert not held and blocks.num_free == blocks.num_blocks, f"blocks still referenced: {held[:8]}"
