"""06_benchmark_offline.py: the statistics on known numbers, the loop on a fake engine, a tiny real run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import load_script

bench = load_script("06_benchmark_offline")
engine_mod = load_script("04_engine")
contracts = load_script("03_contracts")
Record = bench.RequestRecord


# --- statistics on hand-made numbers ---------------------------------------------------------

def test_summary_percentiles_interpolate_between_ranks():
    values = [100, 10, 30, 20, 40, 50, 60, 70, 80, 90]   # order must not matter
    summary = bench.summarize(values)
    assert summary["p50"] == 55.0
    assert summary["p90"] == pytest.approx(91.0)   # rank 8.1: 90 + 0.1 * 10
    assert summary["p99"] == pytest.approx(99.1)
    assert bench.summarize([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}


def test_summarize_skips_unmeasured_values():
    assert bench.summarize([]) is None
    assert bench.summarize([None, None]) is None   # an engine that does not report TTFT
    assert bench.summarize([1.0, None, 3.0]) == {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": pytest.approx(2.98)}


def test_bench_stats_adds_up_known_records():
    records = [Record(250.0, 10, 1), Record(500.0, 20, 2), Record(750.0, 30, 3),
               Record(5.0, error="HTTP 400: bad prompt")]            # failures count but do not skew latency
    stats = bench.bench_stats("fake", records, duration_s=1.5)
    assert (stats.requests, stats.failed, stats.input_tokens, stats.output_tokens) == (3, 1, 60, 6)
    assert stats.requests_per_s == 2.0 and stats.output_tokens_per_s == 4.0
    assert stats.latency_ms == {"mean": 500.0, "p50": 500.0, "p90": 700.0, "p99": 745.0}
    assert stats.ttft_ms is None and stats.tpot_ms is None and stats.itl_ms is None
    with pytest.raises(ValueError):
        bench.bench_stats("fake", records, duration_s=0.0)


def test_bench_stats_pools_inter_token_gaps_across_requests():
    records = [Record(100.0, 1, 3, ttft_ms=40.0, tpot_ms=30.0, itl_ms=[20.0, 40.0]),
               Record(60.0, 1, 2, ttft_ms=20.0, tpot_ms=40.0, itl_ms=[40.0])]
    stats = bench.bench_stats("fake", records, duration_s=0.16)
    assert stats.ttft_ms["mean"] == 30.0 and stats.tpot_ms["p50"] == 35.0
    assert stats.itl_ms["mean"] == pytest.approx(100 / 3) and stats.itl_ms["p50"] == 40.0


# --- the measured loop on a fake engine with a fake clock -------------------------------------

class FakeClock:
    """Stands in for the `time` module inside the benchmark: time moves only when an engine works."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class FakeEngine(engine_mod.BaseOfflineEngine):
    """Emits min(max_new_tokens, len(prompt)) tokens (all of them with ignore_eos), 250 ms per token."""

    seconds_per_token = 0.25
    reports_loop_metrics = False

    def __init__(self, clock: FakeClock, calls: list):
        self.clock, self.calls, self.tokenizer = clock, calls, None   # no chat template: plain transcript

    def generate(self, prompt, max_new_tokens, params=None):
        params = params or contracts.SamplingParams()
        n = max_new_tokens if params.ignore_eos else min(max_new_tokens, len(prompt))
        self.clock.now += self.seconds_per_token * n
        self.calls.append((type(self).__name__, prompt))
        ttft, tpot = (8.0 * n, 4.0) if self.reports_loop_metrics else (None, None)
        metrics = contracts.RequestMetrics(n / (self.seconds_per_token * n), len(prompt), n, ttft, tpot)
        return contracts.GenerateResult("x" * n, list(range(n)), metrics)

    def generate_batch(self, prompts, max_new_tokens, params=None):
        return [self.generate(p, max_new_tokens, params) for p in prompts]


class FakeLoopEngine(FakeEngine):
    """Twice as fast, and it measures TTFT/TPOT like the engines of Chapter 2 on."""

    seconds_per_token = 0.125
    reports_loop_metrics = True


def table_row(printed: str, name: str) -> list[str] | None:
    """The cells of one line of the printed table."""
    for line in printed.splitlines():
        if line.startswith(f"  {name} "):
            return line[len(name) + 2:].split()
    return None


@pytest.fixture
def fake_world(monkeypatch, tmp_path):
    clock, calls = FakeClock(), []
    classes = {"fake:FakeEngine": FakeEngine, "fake:FakeLoopEngine": FakeLoopEngine}
    monkeypatch.setattr(bench, "time", clock)
    monkeypatch.setattr(bench.engine_mod, "load_engine", lambda spec, model, device: classes[spec](clock, calls))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"text": "a"}, {"text": "bb"}, {"text": "cccc"}]}))
    return calls, str(prompts)


def test_measured_runs_use_engine_token_counts_and_discard_warmup(fake_world, tmp_path, capsys):
    calls, prompts = fake_world
    out = tmp_path / "res.json"
    result = bench.main(["--engine", "fake:FakeEngine", "--prompts", prompts, "--max-new-tokens", "3",
                         "--runs", "2", "--warmup", "2", "--json", str(out)])
    assert [p for _, p in calls] == ["a", "bb"] + ["a", "bb", "cccc"] * 2   # 2 warm-up calls first
    (stats,) = result["stats"]
    # Tokens 1, 2, 3 (not 3 x max_new_tokens), at 250 ms per token, twice over.
    assert (stats.requests, stats.output_tokens, stats.duration_s) == (6, 12, 3.0)
    assert stats.output_tokens_per_s == 4.0 and stats.requests_per_s == 2.0
    assert stats.latency_ms == {"mean": 500.0, "p50": 500.0, "p90": 750.0, "p99": 750.0}
    printed = capsys.readouterr().out
    assert table_row(printed, "output_tokens/s") == ["4.00"]
    assert "ttft_ms" not in printed   # not measured: the line is omitted, not printed as 0 or None
    saved = json.loads(out.read_text())
    assert saved["config"]["engine"] == ["fake:FakeEngine"] and saved["config"]["max_new_tokens"] == 3
    assert [r["output_tokens"] for r in saved["results"][0]["requests"]] == [1, 2, 3, 1, 2, 3]


def test_ignore_eos_makes_equal_work(fake_world):
    _, prompts = fake_world
    result = bench.main(["--engine", "fake:FakeEngine", "--prompts", prompts, "--max-new-tokens", "3",
                         "--runs", "1", "--warmup", "0", "--ignore-eos"])
    assert [r.output_tokens for r in result["records"][0]] == [3, 3, 3]


def test_comparison_alternates_engines_and_reports_ratios(fake_world, capsys):
    calls, prompts = fake_world
    result = bench.main(["--engine", "fake:FakeEngine", "--engine", "fake:FakeLoopEngine", "--prompts", prompts,
                         "--max-new-tokens", "3", "--runs", "2", "--warmup", "0"])
    order = [name for name, _ in calls]
    assert order == ["FakeEngine"] * 3 + ["FakeLoopEngine"] * 3 + ["FakeEngine"] * 3 + ["FakeLoopEngine"] * 3
    base, loop = result["stats"]
    assert (base.name, loop.name) == ("FakeEngine", "FakeLoopEngine")
    assert loop.output_tokens_per_s == 2 * base.output_tokens_per_s == 8.0
    assert base.ttft_ms is None and loop.ttft_ms == {"mean": 16.0, "p50": 16.0, "p90": 24.0, "p99": 24.0}
    printed = capsys.readouterr().out
    assert table_row(printed, "output_tokens/s") == ["4.00", "8.00", "(2.00x)"]
    assert table_row(printed, "ttft_ms mean") == ["-", "16.0"]   # the baseline cannot measure TTFT


def test_batch_mode_times_whole_chunks(fake_world):
    _, prompts = fake_world
    result = bench.main(["--engine", "fake:FakeEngine", "--prompts", prompts, "--max-new-tokens", "3",
                         "--runs", "1", "--warmup", "0", "--batch", "--batch-size", "2"])
    # Chunk ["a", "bb"] takes 0.75 s, chunk ["cccc"] 0.75 s: each request waits for its chunk.
    assert [r.latency_ms for r in result["records"][0]] == [750.0, 750.0, 750.0]
    assert result["stats"][0].output_tokens_per_s == 4.0


def test_engine_labels_disambiguate_repeats():
    assert bench.engine_labels(["04_engine:BaselineEngine", "07_decode_loop:DecodeLoopEngine",
                                "04_engine:BaselineEngine"]) == ["BaselineEngine", "DecodeLoopEngine",
                                                                 "BaselineEngine#2"]


# --- the committed workload and a small real run ----------------------------------------------

def test_committed_prompts_are_varied(tiny_engine, tmp_path):
    prompts = bench.load_prompts()
    assert len(prompts) == 16
    assert any("messages" in p for p in prompts) and any("text" in p for p in prompts)
    lengths = [len(tiny_engine.tokenizer(bench.prompt_text(tiny_engine, p)).input_ids) for p in prompts]
    assert min(lengths) < 16 and max(lengths) > 300
    assert max(lengths) + 64 <= tiny_engine.context_length   # fits even the tiny test model
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompts": [{"text": "hi", "messages": []}]}))
    with pytest.raises(ValueError):
        bench.load_prompts(bad)


def test_real_run_writes_json_and_png(tiny_model_dir, tmp_path):
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    result = bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--num-prompts", "3", "--runs", "1",
                         "--warmup", "1", "--max-new-tokens", "4", "--ignore-eos",
                         "--json", str(out), "--plot", str(png)])
    saved = json.loads(out.read_text())
    (entry,) = saved["results"]
    stats = entry["stats"]
    assert stats["name"] == "BaselineEngine" and stats["requests"] == 3 and stats["failed"] == 0
    assert stats["output_tokens"] == 12 and stats["output_tokens_per_s"] > 0
    assert 0 < stats["latency_ms"]["p50"] <= stats["latency_ms"]["p99"]
    assert stats["ttft_ms"] is None   # HF generate hides its loop
    assert [r["input_tokens"] for r in entry["requests"]] == [r.input_tokens for r in result["records"][0]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
