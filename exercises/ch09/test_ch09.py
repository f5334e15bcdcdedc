"""Chapter 9's exercises, on the real Scheduler with made-up requests, as 13_scheduler.py runs it."""

from harness import catches, patched, within
from minivllm.block_manager import BlockManager
from minivllm.contracts import SamplingParams
from minivllm.output import Request
from minivllm.scheduler import Scheduler


def requests(shapes):
    return [Request(i, list(range(100 + i, 100 + i + n)), SamplingParams(), budget, detok=None)
            for i, (n, budget) in enumerate(shapes)]


def run(scheduler, reqs, max_steps=200):
    """Every step's (request id, start, length), and each request's step of its first token."""
    for r in reqs:
        scheduler.add(r)
    steps, first = [], {}
    while scheduler.has_work() and len(steps) < max_steps:
        work = scheduler.schedule()
        steps.append([(r.id, s, n, s < r.n_prompt) for r, s, n in zip(work.requests, work.starts, work.lengths)])
        for r, n in zip(work.requests, work.lengths):
            r.num_computed += n
            if r.num_computed == r.num_tokens:     # the model samples one token here
                first.setdefault(r.id, len(steps) - 1)
                r.new_ids.append(0)
                if len(r.new_ids) == r.budget:
                    scheduler.finish(r)
    return steps, first


def test_9_1_chunks(answers):
    _, first = run(Scheduler(BlockManager(64, 16), 4, 32), requests([(100, 2)]))
    within(answers.STEP_OF_FIRST_TOKEN, first[0], what="STEP_OF_FIRST_TOKEN")


def test_9_2_decodes_first(answers):
    _, first = run(Scheduler(BlockManager(64, 16), 4, 16), requests([(10, 5), (30, 5)]))
    within(answers.STEP_OF_R1_FIRST_TOKEN, first[1], what="STEP_OF_R1_FIRST_TOKEN")


def test_9_3_chunk_cap(answers):
    reqs = requests([(70, 3), (5, 6), (40, 2), (3, 4)])
    scheduler = answers.ChunkCapScheduler(BlockManager(64, 4), 4, 32, cap=12)
    steps, _ = run(scheduler, reqs)
    assert not scheduler.has_work() and all(len(r.new_ids) == r.budget for r in reqs), "not every request finished"
    long = [(rid, n) for step in steps for rid, s, n, prefill in step if prefill and n > 12]
    assert not long, f"prefill chunks over the cap: {long}"
    assert scheduler.blocks.num_free == 64


# --- the planted defect (read it after you have tried) ---------------------------------------
def finished_keep_blocks(original):
    def finish(self, r):
        if r in self.running:
            self.running.remove(r)          # leaves, and forgets to free its blocks
        else:
            original(self, r)
    return finish


def served():
    scheduler = Scheduler(BlockManager(8, 4), 3, 8)
    run(scheduler, requests([(10, 3), (3, 4), (6, 2), (2, 3)]))
    return scheduler


def test_9_4_find_the_bug(answers):
    catches(answers.check_blocks_come_back, lambda: patched("minivllm.scheduler:Scheduler.finish",
                                                            finished_keep_blocks), served,
            what="check_blocks_come_back")
