"""Chapter 5's exercises, on 09_static_batching.py."""

import importlib

import pytest

from harness import catches, patched, within

static = importlib.import_module("09_static_batching")


def test_5_1_prefill_padding(answers):
    within(answers.PREFILL_PADDING_SHARE, static.padding_waste([10, 20, 30, 40], 11)[0], abs_=0.01,
           what="PREFILL_PADDING_SHARE")


def test_5_2_decode_padding(answers):
    within(answers.DECODE_PADDING_SHARE, static.padding_waste([10, 40], 11)[1], abs_=0.02,
           what="DECODE_PADDING_SHARE")


# --- the planted defect (read it after you have tried) ---------------------------------------
def mask_dropped(original):
    def left_pad(self, prompts):
        input_ids, _, positions = original(self, prompts)
        return input_ids, None, positions          # every row attends to its pads
    return left_pad


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return static.StaticBatchEngine(str(tiny_model_dir), device="cpu")


def test_5_3_find_the_bug(answers, engine):
    catches(answers.check_batching, lambda: patched("09_static_batching:StaticBatchEngine.left_pad",
                                                    mask_dropped),
            lambda: engine, what="check_batching")
