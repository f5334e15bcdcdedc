"""Chapter 1 exercises: sampling and the contract (solutions)."""

import torch


# Exercise 1.1 (predict, then measure). Logits [3, 2, 1, 0, -1]: how many tokens survive
# top_p = 0.9 (minivllm.sampling.top_p_filter)? Tolerance: exact.
# why: softmax: 0.636, 0.234, 0.086, 0.032, 0.012; the mass ranked above token 4 is 0.956 >= 0.9.
TOP_P_SURVIVORS = 3


# Exercise 1.2 (predict, then measure). Top-k 2, then top-p 0.5 on the same logits: how many
# survive? Tolerance: exact.
# why: Top-k leaves [3, 2]; renormalised 0.731 and 0.269; 0.731 >= 0.5.
TOP_K_THEN_TOP_P_SURVIVORS = 1


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Exercise 1.3 (extend): vLLM's min_p. Keep a token when its probability is at least
    min_p times the likeliest token's; set the others to -inf. Rows of a [batch, vocab] block
    are independent; min_p = 0 keeps everything."""
    probs = logits.float().softmax(dim=-1)
    floor = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def check_repetition_penalty(apply_repetition_penalty) -> None:
    """Exercise 1.4 (find the bug): raise AssertionError if this apply_repetition_penalty ever
    makes a seen token more likely than it was. Called with the real function and with one
    that has a defect planted."""
    logits = torch.tensor([[2.0, -2.0, 0.5, -0.5]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([[1.5]]))
    assert torch.all(out[seen] < logits[seen]), f"a seen token gained: {logits} -> {out}"
    assert torch.equal(out[~seen], logits[~seen]), "an unseen token changed"
