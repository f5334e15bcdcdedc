"""Chapter 3's exercises: the cache the tiny model fills, the book's FLOP count, the formula."""

import importlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import within
from minivllm.model_files import DEFAULT_MODEL, resolve_model
from minivllm.roofline import kv_bytes_per_token

sizes = importlib.import_module("08_kv_cache_sizes")
kv_cache = importlib.import_module("08_kv_cache")


def smollm_config():
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(resolve_model(DEFAULT_MODEL))


def test_3_1_bytes_per_token(answers, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)("a prompt of a few tokens", return_tensors="pt").input_ids
    total, tokens = sizes.measured_cache_bytes(sizes.filled_cache(model, ids))
    within(answers.TINY_KV_BYTES_PER_TOKEN, total / tokens, what="TINY_KV_BYTES_PER_TOKEN")


def test_3_2_flops_ratio(answers):
    config = smollm_config()
    ratio = kv_cache.step_flops(config, 200, False) / kv_cache.step_flops(config, 200, True)
    within(answers.FLOPS_RATIO_AT_200, ratio, rel=0.10, what="FLOPS_RATIO_AT_200")


def test_3_3_sliding_window(answers):
    config = smollm_config()
    per = kv_bytes_per_token(config, torch.bfloat16)
    for tokens, window in ((100, None), (100, 4096), (10_000, 4096), (4096, 4096)):
        expected = per * (tokens if window is None else min(tokens, window))
        assert answers.sliding_window_kv_bytes(config, tokens, torch.bfloat16, window) == expected, (tokens, window)
