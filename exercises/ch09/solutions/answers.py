"""Chapter 9 exercises: the scheduler (minivllm/scheduler.py, 13_scheduler.py) (solutions)."""

from minivllm.scheduler import Scheduler


# Exercise 9.1 (predict, then measure). One request with a 100-token prompt, a step budget of
# max_num_batched_tokens=32: in which step (counting from 0) is its first token sampled?
# Tolerance: exact.
# why: the prompt goes in chunks of 32, 32, 32 and 4; the fourth chunk's logits give the token.
STEP_OF_FIRST_TOKEN = 3


# Exercise 9.2 (predict, then measure). Two requests arrive together: r0 with a 10-token
# prompt, r1 with 30; budget 16 tokens a step. In which step is r1's first token sampled?
# Tolerance: exact.
# why: step 0 is r0's 10 + r1's first 6; step 1 is r0's decode + 15 of r1; step 2 is r0's decode
# + r1's last 9: decodes go first, and r1's prefill gets what they leave.
STEP_OF_R1_FIRST_TOKEN = 2


class ChunkCapScheduler(Scheduler):
    """Exercise 9.3 (extend): vLLM's long_prefill_token_threshold. No prefill chunk of any request
    is longer than `cap` tokens in one step, so one long prompt cannot take the whole budget from
    the others; decodes and everything else behave as before. Checked on made-up requests: every
    chunk within the cap, every request finished."""

    def __init__(self, blocks, max_num_seqs: int, max_num_batched_tokens: int, cap: int):
        super().__init__(blocks, max_num_seqs, max_num_batched_tokens)
        self.cap = cap

    def schedule(self):
        """The step as the Scheduler plans it, with every prefill chunk cut to the cap."""
        out = super().schedule()
        for i, n in enumerate(out.lengths):
            r = out.requests[i]
            if n > self.cap:          # give back the slots past the cap; they come in a later step
                out.lengths[i] = self.cap
                self.blocks.truncate(r.id, max(r.num_computed + self.cap, 1))
        return out


def check_blocks_come_back(scheduler) -> None:
    """Exercise 9.4 (find the bug): this scheduler (over a BlockManager of 8 blocks of 4) has just
    served four requests to the end. Raise AssertionError if it kept any block. Called on the
    real Scheduler and on one with a defect planted."""
    assert not scheduler.has_work()
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks, \
        f"{scheduler.blocks.num_blocks - scheduler.blocks.num_free} blocks never came back"
