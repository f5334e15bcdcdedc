"""Chapter 7's exercises, on the real BlockManager."""

import math
import random

from harness import catches, patched, within
from minivllm.block_manager import BlockManager


def test_7_1_blocks(answers):
    m = BlockManager(16, 16)
    for seq, n in enumerate((5, 16, 17)):
        m.allocate(seq, n)
    within(answers.BLOCKS_IN_USE, m.num_blocks - m.num_free, what="BLOCKS_IN_USE")


def test_7_2_slot(answers):
    m = BlockManager(8, 16)
    m.allocate(0, 16)
    m.allocate(1, 4)
    slots = [m.append_slot(0) for _ in range(5)]
    within(answers.SLOT_OF_TOKEN_20, slots[-1], what="SLOT_OF_TOKEN_20")


def test_7_3_watermark(answers):
    rng = random.Random(0)
    for _ in range(200):
        m = BlockManager(rng.randint(4, 40), 16)
        for seq in range(rng.randint(0, 5)):
            if m.num_free:
                m.allocate(seq, rng.randint(1, 16 * m.num_free))
        n, w = rng.randint(1, 200), rng.choice([0.0, 0.01, 0.1, 0.25])
        expected = m.num_free - m.blocks_for(n) >= math.ceil(w * m.num_blocks)
        assert answers.can_admit(m, n, w) == expected, (m.num_blocks, m.num_free, n, w)


# --- the planted defect (read it after you have tried) ---------------------------------------
def block_left_on_free_list(original):
    def take(self):
        block = original(self)
        self.free_blocks.append(block)      # handed out, and still free
        return block
    return take


def test_7_4_find_the_bug(answers):
    catches(answers.check_no_double_ownership,
            lambda: patched("minivllm.block_manager:BlockManager._take", block_left_on_free_list),
            lambda: BlockManager, what="check_no_double_ownership")
