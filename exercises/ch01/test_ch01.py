"""Chapter 1's exercises, checked against the real sampling functions (minivllm/sampling.py)."""

import torch

from harness import catches, patched, within
from minivllm import sampling

LOGITS = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])


def survivors(logits: torch.Tensor) -> int:
    return int(torch.isfinite(logits).sum())


def test_1_1_top_p_survivors(answers):
    within(answers.TOP_P_SURVIVORS, survivors(sampling.top_p_filter(LOGITS, 0.9)), what="TOP_P_SURVIVORS")


def test_1_2_top_k_then_top_p(answers):
    measured = survivors(sampling.top_p_filter(sampling.top_k_filter(LOGITS, 2), 0.5))
    within(answers.TOP_K_THEN_TOP_P_SURVIVORS, measured, what="TOP_K_THEN_TOP_P_SURVIVORS")


def test_1_3_min_p(answers):
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    out = answers.min_p_filter(logits, 0.1)
    probs = logits.softmax(-1)
    keep = probs >= 0.1 * probs.max(-1, keepdim=True).values
    assert torch.equal(torch.isfinite(out), keep), "kept the wrong tokens"
    assert torch.equal(out[keep], logits[keep]), "a kept logit changed"
    assert torch.equal(answers.min_p_filter(logits, 0.0), logits), "min_p = 0 must keep everything"
    assert survivors(answers.min_p_filter(logits, 1.0)[0]) >= 1, "the likeliest token is always kept"


# --- the planted defect (read it after you have tried) ---------------------------------------
def negative_logits_divided(original):
    """Seen tokens with negative logits are divided by the penalty, as positive ones are: they gain."""
    def buggy(logits, seen, penalty):
        return torch.where(seen & (logits < 0), logits / penalty, original(logits, seen, penalty))
    return buggy


def test_1_4_find_the_bug(answers):
    catches(answers.check_repetition_penalty,
            lambda: patched("minivllm.sampling:apply_repetition_penalty", negative_logits_divided),
            lambda: sampling.apply_repetition_penalty, what="check_repetition_penalty")
