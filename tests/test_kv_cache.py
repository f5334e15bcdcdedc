"""08_kv_cache.py: the cache-size formula, and the cache changing speed but not tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script

kv = load_script("08_kv_cache")
setup = load_script("01_setup")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tokenizer, model = setup.load_model(str(tiny_model_dir), device=torch.device("cpu"))
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
    held, tokens_cached = kv.measured_cache_bytes(cached.cache)
    # The last generated token is never fed back, so it is not in the cache.
    assert tokens_cached == prompt_ids.shape[1] + len(cached.tokens) - 1
    per_token = kv.kv_bytes_per_token(model.config, torch.float32)
    # tiny config: 2 layers, 2 KV heads, head_dim 64/4 = 16, float32
    assert per_token == 2 * 2 * 2 * 16 * 4
    assert held == per_token * tokens_cached


def test_formula_scales_with_dtype_and_heads(tiny):
    _, model, _ = tiny
    fp32 = kv.kv_bytes_per_token(model.config, torch.float32)
    assert kv.kv_bytes_per_token(model.config, torch.bfloat16) * 2 == fp32
    # full multi-head attention: 4 KV heads instead of 2 doubles the cache
    assert kv.kv_bytes_per_token(model.config, torch.float32, kv_heads=4) == 2 * fp32


def test_measured_bytes_follow_the_cache_dtype(tiny_model_dir, tiny):
    _, _, prompt_ids = tiny
    _, half = setup.load_model(str(tiny_model_dir), device=torch.device("cpu"), dtype=torch.bfloat16)
    cached, _ = decode(half, prompt_ids, steps=3)
    held, tokens_cached = kv.measured_cache_bytes(cached.cache)
    assert held == kv.kv_bytes_per_token(half.config, torch.bfloat16) * tokens_cached


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
        cached = kv.DecodeRun(prompt_ids, kv.DynamicCache())
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
    held, tokens_cached = kv.measured_cache_bytes(cached.cache)
    assert tokens_cached == prompt_ids.shape[1] + 4
    assert held == kv.kv_bytes_per_token(model.config, torch.float32) * tokens_cached
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
