"""Chapter 5's static batching: a prompt's output must not depend on its batch mates."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import load_script
from minivllm.contracts import SamplingParams

N_NEW = 24


@pytest.fixture(scope="module")
def batch_mod():
    return load_script("09_static_batching")


@pytest.fixture(scope="module")
def tiny_batch(batch_mod, tiny_model_dir):
    return batch_mod.StaticBatchEngine(str(tiny_model_dir), device="cpu")


def top2_margin(engine, prompt: str, prefix: list[int]) -> tuple[float, list[int]]:
    """Gap between the two best logits after prompt + prefix, computed alone, without a cache."""
    ids = torch.cat([engine.tokenizer(prompt, return_tensors="pt").input_ids,
                     torch.tensor([prefix], dtype=torch.long)], dim=1)
    with torch.inference_mode():
        logits = engine.model(ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def assert_matches_solo(engine, prompt: str, solo, batched) -> None:
    """Token-for-token equality; a float32 near-tie is the only accepted explanation for a difference.

    Padding changes the matmul shapes, so a padded row's logits may differ from the solo
    ones in the last bits. That can flip an argmax only where the two best logits are
    within that noise of each other, so a divergence must sit on such a near-tie, with the
    batched token being the runner-up. Anything else is a bug.
    """
    if batched.output_ids == solo.output_ids:
        assert (batched.text, batched.finish_reason) == (solo.text, solo.finish_reason)
        return
    k = next(i for i, (a, b) in enumerate(zip(solo.output_ids + [None], batched.output_ids + [None])) if a != b)
    assert k < min(len(solo.output_ids), len(batched.output_ids)), "same tokens, different length"
    margin, top2 = top2_margin(engine, prompt, solo.output_ids[:k])
    assert margin < 1e-3 and batched.output_ids[k] in top2, (
        f"batched output diverges at token {k} where the top-2 margin is {margin:.2e}: not a float32 tie")
    warnings.warn(f"float32 near-tie: batched row diverges at token {k} (top-2 margin {margin:.1e})")


def test_max_batch_size_is_validated(batch_mod):
    with pytest.raises(ValueError):
        batch_mod.StaticBatchEngine("unused", max_batch_size=0)


def test_left_pad_mask_and_positions(tiny_batch):
    short, long = torch.tensor([[11, 12, 13]]), torch.tensor([[21, 22, 23, 24, 25, 26]])
    input_ids, mask, positions = tiny_batch.left_pad([short, long])
    assert input_ids.tolist() == [[tiny_batch.pad_token_id] * 3 + [11, 12, 13], [21, 22, 23, 24, 25, 26]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]
    assert positions[0, 3:].tolist() == [0, 1, 2] and positions[1].tolist() == list(range(6))
    _, mask, _ = tiny_batch.left_pad([short, short])
    assert mask is None      # nothing to mask: the unpadded fast path


def test_batch_equals_each_prompt_alone(tiny_batch, tiny_engine, reference_prompts):
    batched = tiny_batch.generate_batch(reference_prompts, N_NEW)
    lengths = [r.metrics.input_tokens for r in batched]
    assert max(lengths) > 5 * min(lengths)          # very different lengths: lots of padding
    for prompt, result in zip(reference_prompts, batched):
        assert_matches_solo(tiny_batch, prompt, tiny_batch.generate(prompt, N_NEW), result)
    # and the solo path is Chapter 1's output
    assert batched[0].output_ids == tiny_engine.generate(reference_prompts[0], N_NEW).output_ids


def test_rows_that_end_early(tiny_batch, reference_prompts, monkeypatch):
    # The random tiny model never picks the real EOS: declare a token of row 0's output to be EOS,
    # and give row 2 a stop string from its own output, so rows stop at different steps.
    eos = tiny_batch.generate(reference_prompts[0], 12).output_ids[3]
    monkeypatch.setattr(tiny_batch.output, "eos_token_ids", {eos})   # the output processor decides
    stop = tiny_batch.tokenizer.decode(tiny_batch.generate(reference_prompts[2], 12).output_ids[6:8])
    params = SamplingParams(stop=(stop,))
    batched = tiny_batch.generate_batch(reference_prompts, 12, params)
    for prompt, result in zip(reference_prompts, batched):
        assert_matches_solo(tiny_batch, prompt, tiny_batch.generate(prompt, 12, params), result)
        assert result.metrics.output_tokens == len(result.output_ids)
    assert batched[0].finish_reason == "stop" and batched[0].output_ids[-1] == eos
    assert batched[2].finish_reason == "stop" and stop not in batched[2].text
    assert len(batched[0].output_ids) < 12 and "length" in {r.finish_reason for r in batched}
    # a row that finished early reports its own (earlier) last-token time
    assert batched[0].metrics.output_tokens / batched[0].metrics.throughput < \
        max(r.metrics.output_tokens / r.metrics.throughput for r in batched)


def test_split_by_max_batch_size(tiny_batch, reference_prompts, monkeypatch):
    whole = tiny_batch.generate_batch(reference_prompts, 10)
    shapes = []
    prefill = tiny_batch.prefill
    monkeypatch.setattr(tiny_batch, "max_batch_size", 3)
    monkeypatch.setattr(tiny_batch, "prefill", lambda ids, *a: shapes.append(tuple(ids.shape)) or prefill(ids, *a))
    split = tiny_batch.generate_batch(reference_prompts, 10)
    assert [s[0] for s in shapes] == [3, 3, 1]
    for prompt, a, b in zip(reference_prompts, whole, split):
        assert_matches_solo(tiny_batch, prompt, a, b)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_batch, reference_prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    prompts = [reference_prompts[0], reference_prompts[3], reference_prompts[0]]
    batched = tiny_batch.generate_batch(prompts, 12, params)
    assert batched[0].output_ids == batched[2].output_ids   # same seed for every row, by design
    for prompt, result in zip(prompts, batched):
        assert result.output_ids == tiny_batch.generate(prompt, 12, params).output_ids


def test_per_row_metrics(tiny_batch, reference_prompts):
    batched = tiny_batch.generate_batch(reference_prompts[:3], 6)
    assert len({r.metrics.ttft_ms for r in batched}) == 1   # one prefill: one first token for all
    for r in batched:
        assert r.metrics.ttft_ms > 0 and r.metrics.tpot_ms > 0 and r.metrics.throughput > 0
        assert r.metrics.output_tokens == len(r.output_ids) == 6


def test_bad_input(tiny_batch):
    assert tiny_batch.generate_batch([], 4) == []
    for prompts, n in (("a string", 4), (["fine", ""], 4), (["fine"], 0), (["fine " * 600], 4)):
        with pytest.raises(ValueError):
            tiny_batch.generate_batch(prompts, n)


def test_padding_waste(batch_mod):
    assert batch_mod.padding_waste([2, 4], 1) == (0.25, 0.0)
    prefill, decode = batch_mod.padding_waste([2, 4], 3)
    assert prefill == 0.25 and decode == pytest.approx(2 * 2 / (2 * 5 + 2 * 6))
    assert batch_mod.padding_waste([5, 5, 5], 8) == (0.0, 0.0)


@pytest.mark.real_model
def test_real_model_batch_equals_alone(batch_mod, default_model_dir, reference_prompts):
    engine = batch_mod.StaticBatchEngine(str(default_model_dir), device="cpu")
    prompts = [reference_prompts[i] for i in (0, 1, 3, 5)]   # 5 to 126 tokens; the chat one ends on EOS
    batched = engine.generate_batch(prompts, 16)
    for prompt, result in zip(prompts, batched):
        assert_matches_solo(engine, prompt, engine.generate(prompt, 16), result)
    assert {r.finish_reason for r in batched} == {"stop", "length"}


def test_sweep_alternates_rounds_and_reports_the_spread(batch_mod, tiny_batch, capsys):
    table = batch_mod.sweep(tiny_batch, [1, 3], 3, repeats=2)
    assert [r["batch"] for r in table] == [1, 3]
    for row in table:
        assert row["repeats"] == 2 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["tokens_per_s"] > 0 and row["baseline_latency_s"] > 0 and "results" not in row
    assert len(capsys.readouterr().out.strip().splitlines()) == 2   # one printed row per size


def test_the_sweeps_rows_go_through_the_progress_bar_never_over_it(batch_mod, tiny_batch, capsys, monkeypatch):
    """On a terminal tqdm redraws its line in place: a row printed beside it lands on that line.
    The sweep hands each row to the bar, which lifts itself off the line first (tqdm.write)."""
    progress = __import__("kit.progress", fromlist=["Progress"])
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    written = []
    monkeypatch.setattr("tqdm.tqdm.write", classmethod(lambda cls, text, file=None: written.append(text)))
    with progress.Progress(2, "requests", "sweep") as bar:
        table = batch_mod.sweep(tiny_batch, [1], 2, repeats=1, bar=bar)
    assert written == [batch_mod.row_text(table[0])]
    assert batch_mod.row_text(table[0]) not in capsys.readouterr().out   # not printed beside the bar
