"""Chapter 4's exercises: the roofline's counts (08_roofline.py) on SmolLM2's config."""

import importlib

from transformers import AutoConfig

from harness import within
from minivllm.model_files import DEFAULT_MODEL, resolve_model

roofline = importlib.import_module("08_roofline")
CONFIG = AutoConfig.from_pretrained(resolve_model(DEFAULT_MODEL))


def test_4_1_intensity(answers):
    within(answers.DECODE_INTENSITY_BATCH_1, roofline.decode_step_cost(CONFIG, 1, 512).intensity, rel=0.2,
           what="DECODE_INTENSITY_BATCH_1")


def test_4_2_bend(answers):
    measured = roofline.bend_batch(roofline.Roofline(bandwidth=1e11, peak=5e11), CONFIG, 512)
    within(answers.BEND_BATCH, measured, rel=0.3, what="BEND_BATCH")


def test_4_3_int8_weights(answers):
    cost = roofline.decode_step_cost(CONFIG, 8, 512)
    int8 = answers.with_weight_bytes(cost, 1)
    assert int8.weight_bytes == cost.weight_bytes / 4 and int8.flops == cost.flops and int8.kv_bytes == cost.kv_bytes
    assert int8.intensity > cost.intensity
