"""Chapter 6's exercises, on our LlamaModel and the tiny random model, HF as the reference."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import catches, patched, within
from minivllm.model import LlamaModel


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return LlamaModel.from_folder(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)("one two three four five " * 12).input_ids[:60]


def test_6_1_parameters(answers, models):
    within(answers.TINY_PARAMETERS, models[0].num_parameters, rel=0.01, what="TINY_PARAMETERS")


@torch.inference_mode()
def test_6_2_greedy_loop(answers, models, ids):
    ours, hf = models
    expected = hf.generate(torch.tensor([ids[:20]]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert answers.greedy_ids(ours, ids[:20], 12) == expected[0, 20:].tolist()


# --- the planted defect (read it after you have tried) ---------------------------------------
def positions_clamped(original):
    def rope_angles(positions, inv_freq, dtype):
        return original(positions.clamp(max=31), inv_freq, dtype)   # a table that ends at 31
    return rope_angles


@torch.inference_mode()
def test_6_3_find_the_bug(answers, models, ids):
    catches(lambda pair: answers.check_against_hf(*pair, ids),
            lambda: patched("minivllm.model:rope_angles", positions_clamped), lambda: models,
            what="check_against_hf")
