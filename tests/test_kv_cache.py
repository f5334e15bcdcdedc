"""Chapter 3: the cache changing speed but not tokens (08_kv_cache.py), the work each step does
(minivllm/roofline.py's counts), and the cache-size formula checked against real caches
(08_kv_cache_sizes.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import load_script
from minivllm import roofline
from minivllm.model_files import load_hf_model

kv = load_script("08_kv_cache")
sizes = load_script("08_kv_cache_sizes")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tokenizer, model = load_hf_model(str(tiny_model_dir), device=torch.device("cpu"))
    prompt_ids = tokenizer("The KV cache keeps keys and values", return_tensors="pt").input_ids
    return tokenizer, model, prompt_ids


@pytest.fixture(scope="module")
def runs(tiny):
    _, model, prompt_ids = tiny
    return decode(model, prompt_ids, steps=12)


def decode(model, prompt_ids, steps):
    return kv.decode_both(model, prompt_ids, steps)


def test_formula_matches_the_bytes_held_in_the_cache(tiny, runs):
    _, model, prompt_ids = tiny
    cached, _ = runs
    held, tokens_cached = sizes.measured_cache_bytes(cached.cache)
    # The last generated token is never fed back, so it is not in the cache.
    assert tokens_cached == prompt_ids.shape[1] + len(cached.tokens) - 1
    per_token = roofline.kv_bytes_per_token(model.config, torch.float32)
    # tiny config: 2 layers, 2 KV heads, head_dim 64/4 = 16, float32
    assert per_token == 2 * 2 * 2 * 16 * 4
    assert held == per_token * tokens_cached


def test_formula_scales_with_dtype_and_heads(tiny):
    _, model, _ = tiny
    fp32 = roofline.kv_bytes_per_token(model.config, torch.float32)
    assert roofline.kv_bytes_per_token(model.config, torch.bfloat16) * 2 == fp32
    # full multi-head attention: 4 KV heads instead of 2 doubles the cache
    assert roofline.kv_bytes_per_token(model.config, torch.float32, kv_heads=4) == 2 * fp32


def test_measured_bytes_follow_the_cache_dtype(tiny_model_dir, tiny):
    _, _, prompt_ids = tiny
    _, half = load_hf_model(str(tiny_model_dir), device=torch.device("cpu"), dtype=torch.bfloat16)
    cached, _ = decode(half, prompt_ids, steps=3)
    held, tokens_cached = sizes.measured_cache_bytes(cached.cache)
    assert held == roofline.kv_bytes_per_token(half.config, torch.bfloat16) * tokens_cached


def test_cache_does_not_change_the_greedy_tokens(runs):
    cached, uncached = runs
    assert len(cached.tokens) == 12
    assert cached.tokens == uncached.tokens


def test_one_timing_entry_per_step(tiny, runs):
    _, _, prompt_ids = tiny
    n = prompt_ids.shape[1]
    for run in runs:
        assert len(run.step_seconds) == len(run.positions) == len(run.tokens) == 12
        assert run.positions == list(range(n, n + 12))
        assert all(s > 0 for s in run.step_seconds)
    assert runs[1].cache is None


def test_with_cache_feeds_one_token_per_decode_step(tiny):
    _, model, prompt_ids = tiny
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, inp, out: fed.append(inp[0].shape[1]))
    try:
        cached = kv.DecodeRun(prompt_ids, DynamicCache())
        for _ in range(4):
            kv.timed_step(model, cached)
        uncached = kv.DecodeRun(prompt_ids)
        for _ in range(3):
            kv.timed_step(model, uncached)
    finally:
        hook.remove()
    n = prompt_ids.shape[1]
    assert fed == [n, 1, 1, 1, n, n + 1, n + 2]


def test_repeated_timing_redoes_the_same_step(tiny, runs):
    # Repeating a step must roll the cache back first: same tokens, same cache size.
    _, model, prompt_ids = tiny
    cached, uncached = kv.decode_both(model, prompt_ids, steps=5, repeats=3)
    assert cached.tokens == uncached.tokens == runs[0].tokens[:5]
    held, tokens_cached = sizes.measured_cache_bytes(cached.cache)
    assert tokens_cached == prompt_ids.shape[1] + 4
    assert held == roofline.kv_bytes_per_token(model.config, torch.float32) * tokens_cached
    assert len(cached.step_seconds) == len(uncached.step_seconds) == 5


def test_window_median_never_counts_the_prefill_and_keeps_its_width():
    run = kv.DecodeRun(torch.zeros(1, 10, dtype=torch.long))
    run.positions = list(range(10, 22))                  # step 0 (the prefill) attends over 10 tokens
    run.step_seconds = [100.0] + [float(i) for i in range(1, 12)]
    assert kv.window_median(run, 10) == 3.0             # steps 1..5: the window slides off the prefill
    assert kv.window_median(run, 15) == 5.0             # steps 3..7, centred
    assert kv.window_median(run, 21) == 9.0             # steps 7..11: slides inward at the end


def test_main_writes_a_plot_only_when_asked(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["08_kv_cache.py", "--model", str(tiny_model_dir), "--steps", "8",
                                     "--repeats", "1", "--device", "cpu"])
    kv.main()
    out = capsys.readouterr().out
    assert "plot written" not in out and not list(tmp_path.rglob("*.png"))
    assert "prefill" in out and "median of 5 decode steps" in out and "decode" in out


# ---------------------------------------------------------------------------------------------
# What the cache costs: 08_kv_cache_sizes.py
# ---------------------------------------------------------------------------------------------

def test_bytes_per_token_equal_the_tensors_of_a_cache_the_model_fills(tiny):
    _, model, prompt_ids = tiny
    held, tokens = sizes.measured_cache_bytes(sizes.filled_cache(model, prompt_ids))
    assert tokens == prompt_ids.shape[1]
    assert held == roofline.kv_bytes_per_token(model.config, torch.float32) * tokens
    # and one layer's key tensor has exactly the shape the formula multiplies out
    layer = sizes.filled_cache(model, prompt_ids).layers[0]
    assert tuple(layer.keys.shape) == (1, 2, tokens, 16) == tuple(layer.values.shape)


def test_attention_designs_divide_the_cache_by_the_group_size(tiny):
    _, model, _ = tiny
    designs = sizes.attention_variants(model.config)   # tiny: 4 query heads, 2 KV heads
    assert designs == {"multi-head": 4, "grouped-query": 2, "multi-query": 1}
    mha, gqa, mqa = (roofline.kv_bytes_per_token(model.config, torch.float32, kv_heads=n) for n in designs.values())
    assert mha == 2 * gqa == 4 * mqa


def test_llama3_configs_give_the_published_sizes():
    big, bigger = roofline.as_config(roofline.LLAMA3_8B), roofline.as_config(roofline.LLAMA3_70B)
    # 2 x layers x 8 KV heads x 128 x 2 bytes: 128 KiB and 320 KiB per token in bf16
    assert roofline.kv_bytes_per_token(big, torch.bfloat16) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert roofline.kv_bytes_per_token(bigger, torch.bfloat16) == 320 * 1024
    assert roofline.kv_bytes_per_token(big, torch.int8) * 4 == roofline.kv_bytes_per_token(big, torch.float32)
    # the weights from the same fields: the published parameter counts, exactly
    assert roofline.weight_bytes(big, torch.bfloat16) == 2 * 8_030_261_248
    assert roofline.weight_bytes(bigger, torch.bfloat16) == 2 * 70_553_706_496


def test_weight_bytes_from_the_config_equal_the_loaded_weights(tiny):
    _, model, _ = tiny
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())   # a tied head counts once
    assert roofline.weight_bytes(model.config, torch.float32) == loaded


def test_sizes_main_prints_the_check_and_the_tables(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["08_kv_cache_sizes.py", "--model", str(tiny_model_dir), "--device", "cpu"])
    sizes.main()
    out = capsys.readouterr().out
    assert "-> matches" in out and "multi-query" in out and "Llama-3-70B" in out and "128k tokens" in out


# ---------------------------------------------------------------------------------------------
# The work a step does, counted
# ---------------------------------------------------------------------------------------------

def test_forward_flops_by_hand(tiny):
    _, model, _ = tiny
    c = model.config        # hidden 64, MLP 128, 2 layers, 4 heads, 2 KV heads, head_dim 16
    per_layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128
    weights = 2 * 2 * per_layer + 2 * 64 * c.vocab_size
    # one new token after 10 cached ones attends over 11 keys: 4 FLOPs per head_dim per key per head
    assert roofline.forward_flops(c, 1, 10) == weights + 4 * 2 * 4 * 16 * 11
    # three tokens from scratch, causal: 1 + 2 + 3 keys; the LM head still on one row
    assert roofline.forward_flops(c, 3, 0) == 3 * 2 * 2 * per_layer + 2 * 64 * c.vocab_size + 4 * 2 * 4 * 16 * 6
    assert kv.step_flops(c, 11, with_cache=True) == roofline.forward_flops(c, 1, 10)
    assert kv.step_flops(c, 11, with_cache=False) == roofline.forward_flops(c, 11, 0)


def test_forward_flops_equal_what_torch_counts(tiny_model_dir, tiny):
    """torch's FLOP counter, on a decode step of the eager model (attention as plain matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    _, _, prompt_ids = tiny
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    cache = sizes.filled_cache(eager, prompt_ids)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        kv.step_with_cache(eager, prompt_ids[:, -1:], cache)
    assert counter.get_total_flops() == roofline.forward_flops(eager.config, 1, prompt_ids.shape[1])


def test_without_the_cache_each_step_redoes_every_token(tiny):
    _, model, _ = tiny
    c = model.config
    attention_per_key = 4 * 2 * 4 * 16
    weights_per_token = roofline.forward_flops(c, 2, 0) - roofline.forward_flops(c, 1, 0) - 2 * attention_per_key
    with_cache = [kv.step_flops(c, p, True) for p in range(2, 50)]
    without = [kv.step_flops(c, p, False) for p in range(2, 50)]
    step_up = [b - a for a, b in zip(with_cache, with_cache[1:])]
    step_up_without = [b - a for a, b in zip(without, without[1:])]
    # with the cache a step one position later reads one more key, nothing else
    assert set(step_up) == {attention_per_key}
    # without it, a step one position later redoes one more token through every weight, and its
    # attention grows with the position: the per-step cost climbs, the total is a parabola
    assert step_up_without == [weights_per_token + attention_per_key * (p + 1) for p in range(2, 49)]


def test_fit_line_ignores_outliers_and_sums_to_a_parabola():
    xs = list(range(10, 40))
    ys = [2.0 + 0.5 * x for x in xs]
    ys[3], ys[17] = 500.0, 900.0                      # a busy machine's two slow steps
    intercept, slope = kv.fit_line(xs, ys)
    assert slope == pytest.approx(0.5) and intercept == pytest.approx(2.0)
    assert kv.predicted_seconds((2.0, 0.5), 1, 4) == pytest.approx(sum(2.0 + 0.5 * x for x in range(1, 5)))


def test_the_fitted_line_reads_as_words_never_plus_minus():
    assert kv.fit_description(0.2048, 0.0006607) == "step =  204.8 ms +   0.66 ms per token of context"
    falling = kv.fit_description(0.1031, -0.0002742)
    assert "+ -" not in falling and falling.startswith("step =  103.1 ms -   0.27 ms per token of context")
    assert "noise" in falling
