"""Chapter 16 exercises: many answers from one prompt (minivllm/many_answers.py, the block manager's fork) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch16
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 16.1 (predict, then measure). Blocks of 16 tokens; a prompt of 200 tokens asks for n = 8
# answers. Once each answer holds slots for 64 tokens of its own (264 tokens a sequence), how many
# distinct KV blocks are in use? Exact.
BLOCKS_HELD = None


# Exercise 16.2 (predict, then measure). Blocks of 16 tokens; a prompt of 33 tokens asks for n = 4
# answers. How many blocks does copy-on-write copy when the four first write their K/V? Exact.
BLOCKS_COPIED = None


def pick_best_of(answers: list[list[float]], n: int) -> list[int]:
    """Exercise 16.3 (extend): best_of. answers[i] is answer i's per-token log-probabilities (one
    float per token, possibly an empty list). Return the indices of the n answers with the highest
    mean log-probability per token, best first; ties go to the lower index; an empty answer
    counts as a mean of 0. Checked against the engine's own rule on random answers."""
    raise NotImplementedError


def check_answers_give_back_their_blocks(case) -> None:
    """Exercise 16.4 (find the bug): case is (llm, prompt), an LLM without prefix caching. Send one
    request for n = 4 sampled answers and raise AssertionError unless, once it is answered, every
    KV block of the pool is free again (block manager: num_free, num_blocks, ref_counts). Called
    on the real engine and on one with a defect planted."""
    raise NotImplementedError
