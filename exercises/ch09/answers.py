"""Chapter 9 exercises: the scheduler (minivllm/scheduler.py, 13_scheduler.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch09
# (the shipped solutions are in solutions/answers.py: try first)

from minivllm.scheduler import Scheduler


# Exercise 9.1 (predict, then measure). One request with a 100-token prompt, a step budget of
# max_num_batched_tokens=32: in which step (counting from 0) is its first token sampled?
# Tolerance: exact.
STEP_OF_FIRST_TOKEN = None


# Exercise 9.2 (predict, then measure). Two requests arrive together: r0 with a 10-token
# prompt, r1 with 30; budget 16 tokens a step. In which step is r1's first token sampled?
# Tolerance: exact.
STEP_OF_R1_FIRST_TOKEN = None


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
        raise NotImplementedError


def check_blocks_come_back(scheduler) -> None:
    """Exercise 9.4 (find the bug): this scheduler (over a BlockManager of 8 blocks of 4) has just
    served four requests to the end. Raise AssertionError if it kept any block. Called on the
    real Scheduler and on one with a defect planted."""
    raise NotImplementedError
