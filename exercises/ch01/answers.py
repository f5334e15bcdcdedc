"""Chapter 1 exercises: sampling and the contract (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch01
# (the shipped solutions are in solutions/answers.py: try first)

import torch


# Exercise 1.1 (predict, then measure). Logits [3, 2, 1, 0, -1]: how many tokens survive
# top_p = 0.9 (minivllm.sampling.top_p_filter)? Tolerance: exact.
TOP_P_SURVIVORS = None


# Exercise 1.2 (predict, then measure). Top-k 2, then top-p 0.5 on the same logits: how many
# survive? Tolerance: exact.
TOP_K_THEN_TOP_P_SURVIVORS = None


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Exercise 1.3 (extend): vLLM's min_p. Keep a token when its probability is at least
    min_p times the likeliest token's; set the others to -inf. Rows of a [batch, vocab] block
    are independent; min_p = 0 keeps everything."""
    raise NotImplementedError


def check_repetition_penalty(apply_repetition_penalty) -> None:
    """Exercise 1.4 (find the bug): raise AssertionError if this apply_repetition_penalty ever
    makes a seen token more likely than it was. Called with the real function and with one
    that has a defect planted."""
    raise NotImplementedError
