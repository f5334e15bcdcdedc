"""06_benchmark_offline.py and what it shares in kit (bench, workloads): the statistics on known
numbers, the loop on a fake engine, the engine flags, a tiny real run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import load_script
from kit import bench, workloads
from kit.engines import load_engine
from minivllm.contracts import BaseOfflineEngine, GenerateResult, RequestMetrics, SamplingParams

offline = load_script("06_benchmark_offline")
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


def test_the_legend_covers_every_line_of_the_table_with_its_unit():
    record = bench.RequestRecord(100.0, 3, 4, ttft_ms=10.0, tpot_ms=5.0, itl_ms=[5.0])
    rows = list(bench.stat_rows(bench.bench_stats("e", [record], 1.0)))
    lines = bench.legend_lines(rows, "when the client sends it")
    explained = {line.split()[0] for line in lines}
    assert {row.split(" ")[0] for row in rows} <= explained          # duration_s included
    assert "ms from a request's submission" in "\n".join(lines) and "seconds of wall time" in "\n".join(lines)
    assert lines[-1].split() == ["submission", "when", "the", "client", "sends", "it"]
    with pytest.raises(ValueError, match="no legend for table line"):
        bench.legend_lines(["goodness mean"], "now")


def test_progress_in_a_log_is_one_plain_line_per_step_with_an_estimate():
    import io

    from kit import progress

    ticks = iter([0.0, 10.0, 20.0, 30.0, 40.0])
    out = io.StringIO()
    with progress.Progress(4, "requests", "benchmark", stream=out, clock=lambda: next(ticks)) as bar:
        bar.note = "BaselineEngine"
        for _ in range(4):
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 4
    assert lines[0] == "[benchmark] 1/4 requests, 10 s, about 30 s left (BaselineEngine)"
    assert lines[-1] == "[benchmark] 4/4 requests, 40 s (BaselineEngine)"
    assert [progress.duration(s) for s in (45, 192, 5400)] == ["45 s", "3.2 min", "1.5 h"]
    with pytest.raises(ValueError):
        progress.Progress(-1, "requests")


# --- the measured loop on a fake engine with a fake clock -------------------------------------

class FakeClock:
    """Stands in for the `time` module inside the benchmark: time moves only when an engine works."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class FakeEngine(BaseOfflineEngine):
    """Emits min(max_new_tokens, len(prompt)) tokens (all of them with ignore_eos), 250 ms per token."""

    seconds_per_token = 0.25
    reports_loop_metrics = False

    def __init__(self, clock: FakeClock, calls: list):
        self.clock, self.calls, self.tokenizer = clock, calls, None   # no chat template: plain transcript

    def generate(self, prompt, max_new_tokens, params=None):
        params = params or SamplingParams()
        n = max_new_tokens if params.ignore_eos else min(max_new_tokens, len(prompt))
        self.clock.now += self.seconds_per_token * n
        self.calls.append((type(self).__name__, prompt))
        ttft, tpot = (8.0 * n, 4.0) if self.reports_loop_metrics else (None, None)
        metrics = RequestMetrics(n / (self.seconds_per_token * n), len(prompt), n, ttft, tpot)
        return GenerateResult("x" * n, list(range(n)), metrics)

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
    monkeypatch.setattr(offline, "time", clock)
    monkeypatch.setattr(offline, "load_engine", lambda spec, model, device: classes[spec](clock, calls))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"text": "a"}, {"text": "bb"}, {"text": "cccc"}]}))
    return calls, str(prompts)


def test_measured_runs_use_engine_token_counts_and_discard_warmup(fake_world, tmp_path, capsys):
    calls, prompts = fake_world
    out = tmp_path / "res.json"
    result = offline.main(["--engine", "fake:FakeEngine", "--prompts", prompts, "--max-new-tokens", "3",
                         "--runs", "2", "--warmup", "2", "--json", str(out)])
    assert [p for _, p in calls] == ["a", "bb"] + ["a", "bb", "cccc"] * 2   # 2 warm-up calls first
    (stats,) = result["stats"]
    # Tokens 1, 2, 3 (not 3 x max_new_tokens), at 250 ms per token, twice over.
    assert (stats.requests, stats.output_tokens, stats.duration_s) == (6, 12, 3.0)
    assert stats.output_tokens_per_s == 4.0 and stats.requests_per_s == 2.0
    # Latency runs from the run's start, when all three were submitted: 250, 250+500, 750+750 ms.
    assert stats.latency_ms == {"mean": pytest.approx(2500 / 3), "p50": 750.0, "p90": 1500.0, "p99": 1500.0}
    printed = capsys.readouterr().out
    assert table_row(printed, "output_tokens/s") == ["4.00"]
    assert "ttft_ms" not in printed   # not measured: the line is omitted, not printed as 0 or None
    saved = json.loads(out.read_text())
    assert saved["config"]["engine"] == ["fake:FakeEngine"] and saved["config"]["max_new_tokens"] == 3
    assert [r["output_tokens"] for r in saved["results"][0]["requests"]] == [1, 2, 3, 1, 2, 3]


def test_ignore_eos_makes_equal_work(fake_world):
    _, prompts = fake_world
    result = offline.main(["--engine", "fake:FakeEngine", "--prompts", prompts, "--max-new-tokens", "3",
                         "--runs", "1", "--warmup", "0", "--ignore-eos"])
    assert [r.output_tokens for r in result["records"][0]] == [3, 3, 3]


def test_comparison_alternates_engines_and_reports_ratios(fake_world, capsys):
    calls, prompts = fake_world
    result = offline.main(["--engine", "fake:FakeEngine", "--engine", "fake:FakeLoopEngine", "--prompts", prompts,
                         "--max-new-tokens", "3", "--runs", "2", "--warmup", "0"])
    order = [name for name, _ in calls]
    assert order == ["FakeEngine"] * 3 + ["FakeLoopEngine"] * 3 + ["FakeEngine"] * 3 + ["FakeLoopEngine"] * 3
    base, loop = result["stats"]
    assert (base.name, loop.name) == ("FakeEngine", "FakeLoopEngine")
    assert loop.output_tokens_per_s == 2 * base.output_tokens_per_s == 8.0
    # The engine's own TTFT (8, 16, 24 ms) plus the time each request queued: 0, 125, 375 ms.
    assert base.ttft_ms is None and loop.ttft_ms == {"mean": pytest.approx(548 / 3), "p50": 141.0,
                                                     "p90": pytest.approx(399.0), "p99": pytest.approx(399.0)}
    printed = capsys.readouterr().out
    assert table_row(printed, "output_tokens/s") == ["4.00", "8.00", "(2.00x)"]
    assert table_row(printed, "ttft_ms mean") == ["-", "182.7"]   # the baseline cannot measure TTFT


def test_batch_mode_times_whole_chunks(fake_world):
    _, prompts = fake_world
    result = offline.main(["--engine", "fake:FakeEngine", "--prompts", prompts, "--max-new-tokens", "3",
                         "--runs", "1", "--warmup", "0", "--batch", "--batch-size", "2"])
    # Chunk ["a", "bb"] takes 0.75 s, chunk ["cccc"] 0.75 s: each request waits for its chunk,
    # and the second chunk's request waited for the first chunk as well.
    assert [r.latency_ms for r in result["records"][0]] == [750.0, 750.0, 1500.0]
    assert result["stats"][0].output_tokens_per_s == 4.0


def test_engine_labels_disambiguate_repeats():
    assert bench.engine_labels(["04_engine:BaselineEngine", "07_decode_loop:DecodeLoopEngine",
                                "04_engine:BaselineEngine"]) == ["BaselineEngine", "DecodeLoopEngine",
                                                                 "BaselineEngine#2"]
    assert bench.engine_labels(["q:QuantizedEngine --quant int8", "q:QuantizedEngine  --quant int4"]) == \
        ["QuantizedEngine --quant int8", "QuantizedEngine --quant int4"]   # a spec's own flags tell them apart


# --- the engine's feature flags ---------------------------------------------------------------

def test_engine_flags_reach_every_engine_and_only_those_given(fake_world, monkeypatch):
    _, prompts = fake_world
    fake_load, loaded = offline.load_engine, []

    def load(spec, model, device=None, **options):
        loaded.append((spec, options))
        return fake_load(spec, model, device)
    monkeypatch.setattr(offline, "load_engine", load)
    argv = ["--engine", "fake:FakeEngine", "--engine", "fake:FakeLoopEngine", "--prompts", prompts,
            "--max-new-tokens", "1", "--runs", "1", "--warmup", "0"]
    offline.main(argv)
    assert loaded == [("fake:FakeEngine", {}), ("fake:FakeLoopEngine", {})]   # none given: each engine's defaults
    loaded.clear()
    offline.main(argv + ["--kv-memory", "256MB", "--prefix-caching", "--max-num-seqs", "8",
                         "--quant", "int4", "--group-size", "64"])
    given = {"kv_memory": 256 << 20, "prefix_caching": True, "max_num_seqs": 8, "quant": "int4", "group_size": 64}
    assert loaded == [("fake:FakeEngine", given), ("fake:FakeLoopEngine", given)]


def test_an_engine_without_the_feature_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):   # load_engine checks the keywords before any model loads
        offline.main(["--engine", "04_engine:BaselineEngine", "--kv-memory", "64MB"])
    err = capsys.readouterr().err
    assert "04_engine:BaselineEngine does not take kv_memory" in err and "Traceback" not in err


def test_one_run_compares_formats_each_named_by_a_spec_of_its_own(tiny_model_dir, monkeypatch):
    """Chapter 12 side by side: flags inside a quoted spec are that engine's, the others every engine's."""
    built, real = [], offline.load_engine
    monkeypatch.setattr(offline, "load_engine", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    specs = ["16_quantization_engine:QuantizedEngine --quant int8",
             "16_quantization_engine:QuantizedEngine --quant int4 --group-size 32"]
    result = offline.main(["--model", str(tiny_model_dir), "--device", "cpu", "--num-prompts", "1", "--runs", "1",
                           "--warmup", "0", "--max-new-tokens", "2", "--max-num-seqs", "4",
                           *[word for spec in specs for word in ("--engine", spec)]])
    assert [s.name for s in result["stats"]] == ["QuantizedEngine --quant int8",
                                                 "QuantizedEngine --quant int4 --group-size 32"]
    assert [e.quant.split()[0] for e in built] == ["int8", "int4"] and [e.max_num_seqs for e in built] == [4, 4]
    assert result["config"]["engine"] == specs and result["config"]["model"] == str(tiny_model_dir)


# --- the committed workload and a small real run ----------------------------------------------

def test_committed_prompts_are_varied(tiny_engine, tmp_path):
    prompts = workloads.load_prompts()
    assert len(prompts) == 16
    assert any("messages" in p for p in prompts) and any("text" in p for p in prompts)
    lengths = [len(tiny_engine.tokenizer(offline.prompt_text(tiny_engine, p)).input_ids) for p in prompts]
    assert min(lengths) < 16 and max(lengths) > 300
    assert max(lengths) + 64 <= tiny_engine.context_length   # fits even the tiny test model
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompts": [{"text": "hi", "messages": []}]}))
    with pytest.raises(ValueError):
        workloads.load_prompts(bad)


def test_real_run_writes_json_and_png(tiny_model_dir, tmp_path):
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    result = offline.main(["--model", str(tiny_model_dir), "--device", "cpu", "--num-prompts", "3", "--runs", "1",
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


class CallTimes:
    """Wraps a real engine and notes when each generate / generate_batch call began and ended."""

    def __init__(self, engine):
        self.engine, self.spans = engine, []

    def _timed(self, method, *args):
        start = offline.time.perf_counter()
        result = method(*args)
        self.spans.append((start, offline.time.perf_counter()))
        return result

    def generate(self, *args):
        return self._timed(self.engine.generate, *args)

    def generate_batch(self, *args):
        return self._timed(self.engine.generate_batch, *args)


@pytest.mark.parametrize("spec, batch_size", [("04_engine:BaselineEngine", None),
                                              ("09_static_batching:StaticBatchEngine", 1)])
def test_latency_counts_the_queue_of_one_at_a_time_engines(engine_mod, tiny_model_dir, spec, batch_size):
    """All requests are submitted when the run starts, so request k's clock was running while
    the engine served the k-1 before it: its latency covers them (the old per-call clock did not)."""
    engine = CallTimes(load_engine(spec, str(tiny_model_dir), device="cpu"))
    items = [workloads.WorkItem(text, 3) for text in ("One", "Two words", "Three words here")]
    params = SamplingParams(ignore_eos=True)
    if batch_size is None:
        records, seconds = offline.run_sequential(engine, items, params, NoBar())
    else:
        records, seconds = offline.run_batched(engine, items, params, NoBar(), batch_size=batch_size)
    first_start = engine.spans[0][0]   # the run's clock started no later than the first call
    for record, (_, end) in zip(records, engine.spans):
        assert record.latency_ms >= (end - first_start) * 1000
    assert [r.latency_ms for r in records] == sorted(r.latency_ms for r in records)
    assert records[-1].latency_ms <= seconds * 1000


# --- the mixed workload and how each kind of engine meets it ----------------------------------

class CharTokenizer:
    """One token per character: token counts become string lengths."""

    def __call__(self, text):
        return type("Encoded", (), {"input_ids": [ord(c) for c in text]})()

    def decode(self, ids):
        return "".join(map(chr, ids))


def committed_requests() -> list[dict]:
    return workloads.load_workload()["requests"]


def test_mixed_workload_has_the_committed_token_counts_and_budgets(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)   # the real SmolLM2 tokenizer
    spec = committed_requests()
    items = workloads.mixed_workload(tokenizer, 70, seed=0)          # 70 > 64: the list cycles
    wanted = [spec[i % 64] for i in range(70)]
    assert [len(tokenizer(w.prompt).input_ids) for w in items] == [r["prompt_tokens"] for r in wanted]
    assert [w.max_new_tokens for w in items] == [r["max_tokens"] for r in wanted]
    assert len({w.max_new_tokens for w in items}) == 4 and min(r["prompt_tokens"] for r in wanted) < 16
    assert all(w.prompt.strip() and "\n\n" not in w.prompt for w in items)   # text, not ids
    assert workloads.mixed_workload(tokenizer, 8, seed=0) == items[:8]           # deterministic by seed
    other = workloads.mixed_workload(tokenizer, 8, seed=1)
    assert [w.prompt for w in other] != [w.prompt for w in items[:8]]
    assert [len(tokenizer(w.prompt).input_ids) for w in other] == [r["prompt_tokens"] for r in spec[:8]]
    with pytest.raises(ValueError, match="n >= 1"):
        workloads.mixed_workload(tokenizer, 0)


def test_text_of_length_cuts_exactly_or_refuses():
    assert workloads.text_of_length(CharTokenizer(), "hello world", 5) == "hello"
    with pytest.raises(ValueError, match="cannot cut 12 tokens"):
        workloads.text_of_length(CharTokenizer(), "hello world", 12)


class ThreadClock(FakeClock):
    """A reader thread sees the moment its own request finished; the main thread sees the start."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def perf_counter(self) -> float:
        return getattr(self.local, "now", self.now)


class FakeStaticEngine(FakeEngine):
    """generate_batch runs every row to the batch's budget in one loop: 250 ms per step, any batch size."""

    def generate_batch(self, prompts, max_new_tokens, params=None):
        self.calls.append(("batch", len(prompts), max_new_tokens))
        self.clock.now += self.seconds_per_token * max_new_tokens
        return [GenerateResult("x", list(range(max_new_tokens)),
                               RequestMetrics(1.0, len(p), max_new_tokens, 10.0, 5.0))
                for p in prompts]


class FakeSubmitEngine(FakeEngine):
    """An engine loop: every submitted request runs at once and is done after 100 ms per own token."""

    def capabilities(self):
        return super().capabilities().replace(schedules_itself=True)

    def submit(self, prompt, max_new_tokens, params=None):
        self.calls.append(("submit", prompt, max_new_tokens))
        finish, clock = self.clock.now + 0.1 * max_new_tokens, self.clock
        metrics = RequestMetrics(1.0, len(prompt), max_new_tokens, 20.0, 3.0)

        def stream():
            self.calls.append(("read", prompt, max_new_tokens))
            yield "x"
            clock.local.now = finish
            yield GenerateResult("x" * max_new_tokens, list(range(max_new_tokens)), metrics)
        return stream()


class NoBar:
    def update(self, n: int) -> None:
        pass


def test_static_batches_wait_for_the_largest_budget_but_count_only_their_own():
    calls, clock = [], FakeClock()
    engine = FakeStaticEngine(clock, calls)
    items = [workloads.WorkItem("a", 2), workloads.WorkItem("bb", 5), workloads.WorkItem("ccc", 3)]
    saved, offline.time = offline.time, clock
    try:
        records, seconds = offline.run_batched(engine, items, None, NoBar(), batch_size=2)
    finally:
        offline.time = saved
    assert calls == [("batch", 2, 5), ("batch", 1, 3)]                      # one budget per batch: its largest
    assert [r.output_tokens for r in records] == [2, 5, 3]
    assert [r.beyond_budget for r in records] == [3, 0, 0]
    # The first batch waits for 5 steps; the second for those 5, then its own 3.
    assert [r.latency_ms for r in records] == [1250.0, 1250.0, 2000.0] and seconds == 2.0


def test_a_submit_engine_gets_every_request_at_once_with_its_own_budget(monkeypatch):
    calls, clock = [], ThreadClock()
    monkeypatch.setattr(offline, "time", clock)
    items = [workloads.WorkItem(p, b) for p, b in (("a", 30), ("bb", 10), ("ccc", 20))]
    records, seconds = offline.run_submitted(FakeSubmitEngine(clock, calls), items, None, NoBar())
    assert calls[:3] == [("submit", "a", 30), ("submit", "bb", 10), ("submit", "ccc", 20)]   # before any read
    assert sorted(calls[3:]) == [("read", "a", 30), ("read", "bb", 10), ("read", "ccc", 20)]
    assert [r.latency_ms for r in records] == pytest.approx([3000.0, 1000.0, 2000.0])   # each leaves when done
    assert seconds == pytest.approx(3.0) and [r.output_tokens for r in records] == [30, 10, 20]
    assert records[0].ttft_ms == 20.0 and records[0].tpot_ms == 3.0                      # the engine's own


@pytest.fixture
def mixed_world(monkeypatch):
    clock, calls = ThreadClock(), []
    classes = {"fake:FakeEngine": FakeEngine, "fake:FakeStaticEngine": FakeStaticEngine,
               "fake:FakeSubmitEngine": FakeSubmitEngine}

    def load(spec, model, device, **options):   # the fakes have every feature, and ignore them
        engine = classes[spec](clock, calls)
        engine.tokenizer = CharTokenizer()
        return engine
    monkeypatch.setattr(offline, "time", clock)
    monkeypatch.setattr(offline, "load_engine", load)
    return calls


def test_mixed_workload_compares_sequential_static_and_all_at_once(mixed_world, capsys):
    spec = committed_requests()[:4]                       # budgets 32, 32, 32, 256
    result = offline.main(["--workload", "mixed", "--num-prompts", "4", "--runs", "1", "--warmup", "0",
                         "--ignore-eos", "--engine", "fake:FakeEngine", "--engine", "fake:FakeStaticEngine",
                         "--engine", "fake:FakeSubmitEngine", "--batch", "FakeStaticEngine"])
    seq, static, submitted = result["stats"]
    budgets = [r["max_tokens"] for r in spec]
    for records in result["records"]:
        assert [r.input_tokens for r in records] == [r["prompt_tokens"] for r in spec]
    assert seq.output_tokens == static.output_tokens == submitted.output_tokens == sum(budgets) == 352
    assert seq.duration_s == 0.25 * 352 and static.duration_s == 0.25 * 256
    assert submitted.duration_s == pytest.approx(0.1 * 256)   # the longest request's own time
    assert [r.beyond_budget for r in result["records"][1]] == [224, 224, 224, 0]
    printed = capsys.readouterr().out
    assert "BaselineEngine" not in printed and "FakeEngine sequential, FakeStaticEngine batch of 4, " \
        "FakeSubmitEngine all at once, own budgets 32, 256, ignore_eos" in printed
    assert table_row(printed, "output_tokens/s") == ["4.00", "5.50", "(1.38x)", "13.8", "(3.44x)"]
    assert "672 tokens generated past their own request's budget were not counted" in printed


@pytest.mark.parametrize("argv, message", [
    (["--workload", "mixed", "--max-new-tokens", "8"], "drop --max-new-tokens"),
    (["--workload", "mixed", "--prompts", "other.json"], "drop --prompts"),
    (["--workload", "random"], "invalid choice"),
    (["--batch", "NoSuchEngine"], "--batch names engines not given with --engine: NoSuchEngine"),
    (["--batch", "--batch-size", "0"], "argument --batch-size: 0 is out of range: between 1 and 4096"),
    (["--batch-size", "2"], "--batch-size only applies with --batch"),
    (["--workload", "mixed", "--num-prompts", "0"], "argument --num-prompts: 0 is out of range"),
    (["--num-prompts", "1000000000000"], "argument --num-prompts: 1000000000000 is out of range"),
    (["--warmup", "-1"], "argument --warmup: -1 is out of range"),
    (["--max-new-tokens", "nan"], "argument --max-new-tokens: 'nan' is not an integer"),
    (["--seed", "-1"], "argument --seed: -1 is out of range"),
    (["--prompts", ""], "--prompts needs a file name"),
    (["--plot", "x.txt"], "argument --plot: 'x.txt' should end in one of .png"),
    (["--json", "/tmp"], "argument --json: '/tmp' is a folder, not a file name"),
    (["--kv-memory", "lots"], "argument --kv-memory/--kv-cache-memory-bytes: not a memory size: 'lots'"),
    (["--quant", "int3"], "argument --quant/--quantization: invalid choice: 'int3'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is out of range"),
])
def test_bad_flags_are_refused_with_the_reason(argv, message, mixed_world, capsys):
    with pytest.raises(SystemExit):
        offline.main(["--engine", "fake:FakeEngine"] + argv)
    assert message in capsys.readouterr().err


# --- vLLM beside our engines (--peer vllm), with a fake vLLM venv ----------------------------

FAKE_VLLM_OFFLINE = '''import json, os, sys
work = json.load(open(sys.argv[2]))
record = {"argv": sys.argv[1:], "work": work, "env": {k: os.environ.get(k) for k in (
    "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}}
with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
if os.environ.get("FAKE_VLLM_FAIL"):
    sys.exit("RuntimeError: no KV cache space")
print("INFO some start-up chatter")
print(f"workload: {len(work)} requests, output tokens/s median 16.0 (runs [15.0, 16.0, 17.5])")
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A venv whose bin/python runs our interpreter, and a PEERS_DIR whose vllm_offline.py prints what
    the real one prints (at 16 tokens/s) and logs what it was given: the workload, argv and env."""
    import sys

    venv, shared = tmp_path / "vllm-venv", tmp_path / "peers"
    (venv / "bin").mkdir(parents=True)
    shared.mkdir()
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    (shared / "vllm_offline.py").write_text(FAKE_VLLM_OFFLINE)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("PEERS_DIR", str(shared))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("VLLM_VENV", raising=False)
    return {"venv": str(venv), "model": str(model),
            "calls": lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []}


def test_peer_row_ratio_and_workload_match_our_requests(mixed_world, fake_vllm, tmp_path, capsys):
    out = tmp_path / "res.json"
    result = offline.main(["--workload", "mixed", "--num-prompts", "4", "--runs", "2", "--warmup", "1",
                           "--ignore-eos", "--engine", "fake:FakeSubmitEngine", "--model", fake_vllm["model"],
                           "--peer", "vllm", "--peer-venv", fake_vllm["venv"], "--prefix-caching",
                           "--json", str(out), "--plot", str(tmp_path / "res.png")])
    ours, vllm = result["stats"]
    calls = fake_vllm["calls"]()
    assert len(calls) == 2                                  # one vLLM run per measured run, no warm-up run
    order = [c[0] for c in mixed_world if c[0] == "submit"]
    assert len(order) == 1 + 4 * 2                          # ours: 1 warm-up request, 2 measured passes
    budgets = [r["max_tokens"] for r in committed_requests()[:4]]
    ours_items = workloads.mixed_workload(CharTokenizer(), 4)
    for call in calls:   # the very requests our engine got, each its own budget, ignore_eos
        assert call["work"] == [{"prompt": w.prompt, "max_tokens": w.max_new_tokens, "ignore_eos": True}
                                for w in ours_items]
        assert call["argv"][0] == fake_vllm["model"] and call["argv"][2:] == ["--prefix-caching"]
        assert call["env"] == {"OMP_NUM_THREADS": str(offline.torch.get_num_threads()), "VLLM_CPU_KVCACHE_SPACE": "2",
                               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # 352 tokens a run at the median 16 tokens/s: 22 s a run, twice.
    assert (vllm.name, vllm.requests, vllm.output_tokens) == ("vLLM", 8, 2 * sum(budgets))
    assert vllm.duration_s == pytest.approx(44.0) and vllm.output_tokens_per_s == pytest.approx(16.0)
    assert vllm.input_tokens == ours.input_tokens and vllm.latency_ms is None   # counted by our tokenizer
    printed = capsys.readouterr().out
    ratio = 16.0 / ours.output_tokens_per_s
    assert table_row(printed, "output_tokens/s") == [bench.fmt(ours.output_tokens_per_s), "16.0", f"({ratio:.2f}x)"]
    assert f"vLLM / FakeSubmitEngine: output_tokens/s {ratio:.2f}x" in printed
    assert "vLLM all at once (median of its 3 passes)" in printed
    saved = json.loads(out.read_text())
    assert [r["stats"]["name"] for r in saved["results"]] == ["FakeSubmitEngine", "vLLM"]
    assert saved["config"]["peer"]["prefix_caching"] is True and len(saved["config"]["peer"]["printed"]) == 2
    assert (tmp_path / "res.png").read_bytes()[:4] == b"\x89PNG"   # vLLM's bar, and an empty latency box


def test_peer_takes_turns_with_our_engines(mixed_world, fake_vllm, monkeypatch):
    turns = []
    peer_measure = offline.peers.VllmPeer.measure

    def measure(self, items):
        turns.append("vLLM")
        return peer_measure(self, items)
    monkeypatch.setattr(offline.peers.VllmPeer, "measure", measure)
    real_run = offline.run_sequential

    def run(engine, items, params, bar):
        turns.append("ours")
        return real_run(engine, items, params, bar)
    monkeypatch.setattr(offline, "run_sequential", run)
    offline.main(["--workload", "mixed", "--num-prompts", "2", "--runs", "2", "--warmup", "0", "--ignore-eos",
                  "--engine", "fake:FakeEngine", "--model", fake_vllm["model"], "--peer", "vllm",
                  "--peer-venv", fake_vllm["venv"]])
    assert turns == ["ours", "vLLM", "ours", "vLLM"]


def test_absent_peer_says_how_to_install_and_ours_still_run(mixed_world, fake_vllm, tmp_path, capsys):
    result = offline.main(["--workload", "mixed", "--num-prompts", "2", "--runs", "1", "--warmup", "0",
                           "--ignore-eos", "--engine", "fake:FakeEngine", "--peer", "vllm",
                           "--peer-venv", str(tmp_path / "nowhere")])
    printed = capsys.readouterr().out
    assert f"no vLLM venv at {tmp_path / 'nowhere'}" in printed and "install_vllm.sh" in printed
    assert [s.name for s in result["stats"]] == ["FakeEngine"] and "Traceback" not in printed


def test_failing_peer_leaves_our_rows(mixed_world, fake_vllm, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    result = offline.main(["--workload", "mixed", "--num-prompts", "2", "--runs", "2", "--warmup", "0",
                           "--ignore-eos", "--engine", "fake:FakeEngine", "--model", fake_vllm["model"],
                           "--peer", "vllm", "--peer-venv", fake_vllm["venv"]])
    assert [s.name for s in result["stats"]] == ["FakeEngine"] and len(fake_vllm["calls"]()) == 1   # not retried
    printed = capsys.readouterr().out
    assert "vLLM failed, its row is left out: vLLM exited with code 1" in printed and "no KV cache space" in printed


def test_peer_needs_equal_work(mixed_world, capsys):
    with pytest.raises(SystemExit):
        offline.main(["--engine", "fake:FakeEngine", "--peer", "vllm"])
    assert "add --ignore-eos" in capsys.readouterr().err


def test_peer_output_is_parsed_or_refused():
    from kit import peers

    line = "workload: 3 requests, output tokens/s median 257.3 (runs [250.1, 257.3, 260.0])"
    assert peers.parse_rates(f"noise\n{line}\nbatch 1: tokens/s median 40.0\n", 3) == (257.3, [250.1, 257.3, 260.0])
    # Three decimals, as vllm_offline.py prints them: a 1-token prefill's rate keeps its precision.
    precise = "workload: 1 requests, output tokens/s median 9.875 (runs [9.812, 9.875, 10.125])"
    assert peers.parse_rates(precise, 1) == (9.875, [9.812, 9.875, 10.125])
    with pytest.raises(peers.PeerFailed, match="not the 4 it was given"):
        peers.parse_rates(line, 4)
    with pytest.raises(peers.PeerFailed, match="no 'workload:' line"):
        peers.parse_rates("Traceback ...", 3)


def test_peer_scripts_are_found_in_the_repository_or_where_peers_dir_says(tmp_path, monkeypatch):
    from kit import peers

    monkeypatch.delenv("PEERS_DIR", raising=False)
    assert peers.peers_dir() == workloads.REPO_ROOT / "scripts" / "peers"      # the repository's own
    assert (peers.peers_dir() / "vllm_offline.py").is_file() and (peers.peers_dir() / "install_vllm.sh").is_file()
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    assert "Set PEERS_DIR to the folder" in peers.missing(str(tmp_path))          # no vllm_offline.py there
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "elsewhere"))
    assert peers.venv_dir() == tmp_path / "elsewhere" and peers.venv_dir("/x") == Path("/x")


FAKE_VLLM = '''
class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, n): self.token_ids = list(range(n))

class _Output:
    def __init__(self, prompt, n): self.prompt_token_ids, self.outputs = prompt.split(), [_Completion(n)]

class LLM:
    def __init__(self, **settings): self.settings = settings
    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [_Output(p, s.max_tokens) for p, s in zip(prompts, params)]
'''


def test_the_repositorys_vllm_script_prints_what_the_benchmark_reads(tmp_path):
    """scripts/peers/vllm_offline.py against a stand-in `vllm` (the real one lives in its own venv):
    the line it prints is the line kit/peers.py parses, with every request's tokens counted."""
    from kit import peers

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    work = tmp_path / "work.json"
    work.write_text(json.dumps([{"prompt": "a b c", "max_tokens": 5}, {"prompt": "d", "max_tokens": 7}]))
    done = subprocess.run([sys.executable, str(peers.peers_dir() / "vllm_offline.py"), "model", str(work),
                           "--single", "x", "--prefill", "one two three"],
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"workload: 2 requests, output tokens/s median \d+\.\d{3} \(runs \[\d+\.\d{3}, "
                     r"\d+\.\d{3}, \d+\.\d{3}\]\)", done.stdout), done.stdout
    assert "batch 1: tokens/s median" in done.stdout and "prefill: 3 tokens" in done.stdout
    rate, runs = peers.parse_rates(done.stdout, 2)
    assert rate > 0 and len(runs) == 3


# --- the speed table (--workload table): four workloads, one summary --------------------------

def test_table_workloads_have_exact_token_counts_and_budgets(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec, mixed = committed_requests(), workloads.mixed_workload(tokenizer, 32, seed=3)
    (single,) = workloads.single_workload(tokenizer, seed=3)
    assert single == workloads.WorkItem(mixed[0].prompt, 128)
    (prefill,) = workloads.prefill_workload(tokenizer)
    assert len(tokenizer(prefill.prompt).input_ids) == 489 and prefill.max_new_tokens == 1
    assert "\n\n" not in prefill.prompt and prefill.prompt.startswith(workloads.documents()[0][:40])
    assert len(tokenizer(workloads.prefill_workload(tokenizer, 100)[0].prompt).input_ids) == 100
    batch = workloads.batch_workload(tokenizer, seed=3)
    assert [w.prompt for w in batch] == [w.prompt for w in mixed] and {w.max_new_tokens for w in batch} == {128}
    assert [len(tokenizer(w.prompt).input_ids) for w in batch] == [r["prompt_tokens"] for r in spec[:32]]
    assert len(workloads.batch_workload(tokenizer, 5)) == 5
    with pytest.raises(ValueError, match="cannot cut 100000 tokens"):
        workloads.prefill_workload(tokenizer, 100_000)


def summary_block(printed: str, title: str) -> dict[str, list[str]]:
    """The rows of one block of the speed table, from its title line to the next title or 'where'."""
    lines = printed[printed.index(title):].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("  ") or line.startswith("   ") or line.strip() == "where" \
                or line.startswith("  ours /") or line.startswith("  against "):
            break
        name, *cells = line.split()
        rows[name] = cells
    return rows


def test_table_measures_four_workloads_and_sums_them_up(mixed_world, fake_vllm, tmp_path, capsys):
    out, png = tmp_path / "table.json", tmp_path / "table.png"
    result = offline.main(["--workload", "table", "--ignore-eos", "--runs", "1", "--warmup", "1",
                           "--engine", "fake:FakeStaticEngine", "--engine", "fake:FakeSubmitEngine",
                           "--batch", "FakeStaticEngine", "--model", fake_vllm["model"], "--peer", "vllm",
                           "--peer-venv", fake_vllm["venv"], "--json", str(out), "--plot", str(png)])
    mixed_budget = sum(r["max_tokens"] for r in committed_requests()[:32])
    # One request per budget step: the static engine takes 250 ms a step for its whole batch, the
    # engine loop 100 ms a step for each request alone, vLLM 16 output tokens/s on every workload.
    # Prefill: 489 prompt tokens (one token a character) in one step; vLLM's 1 token at 16/s is 1/16 s.
    static = {"batch_1": 128 / 32, "prefill": 489 / 0.25, "batch_32": 32 * 128 / 32, "mixed_32": mixed_budget / 64}
    loop = {"batch_1": 128 / 12.8, "prefill": 489 / 0.1, "batch_32": 32 * 128 / 12.8,
            "mixed_32": mixed_budget / 25.6}
    vllm = {"batch_1": 16.0, "prefill": 489 * 16.0, "batch_32": 16.0, "mixed_32": 16.0}
    summary = result["summary"]
    assert list(summary["rows"]) == ["FakeStaticEngine", "FakeSubmitEngine", "vLLM"]
    for name, wanted in (("FakeStaticEngine", static), ("FakeSubmitEngine", loop), ("vLLM", vllm)):
        assert summary["rows"][name] == pytest.approx(wanted)
    calls = fake_vllm["calls"]()   # one vLLM run per workload, on the very requests ours got
    assert [[w["max_tokens"] for w in c["work"]] for c in calls][:3] == [[128], [1], [128] * 32]
    assert len(calls) == 4 and len(calls[1]["work"][0]["prompt"]) == 489 and len(calls[3]["work"]) == 32

    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].split()[:2] == ["mixed", "32"]   # the table's legend ends it
    assert printed.index("[saved]") < printed.index("[Speed table")
    for key, header in (("batch_1", "[batch 1]"), ("prefill", "[prefill 489 tok]"), ("batch_32", "[batch 32]"),
                        ("mixed_32", "[mixed 32]")):
        assert header in printed   # each workload's line, said as it ends
    table = summary_block(printed, "[Speed table")
    assert table["engine"] == ["batch", "1", "prefill", "489", "tok", "batch", "32", "mixed", "32"]
    assert table["FakeStaticEngine"] == ["4.00", "1956.0", "128.0", bench.fmt(mixed_budget / 64)]
    assert table["vLLM"] == ["16.0", "7824.0", "16.0", "16.0"]
    def ratios(title):   # printed with two decimals: compared to within their rounding
        return {name: [float(cell.rstrip("x")) for cell in cells] for name, cells in summary_block(printed, title).items()}
    vs_vllm = ratios("ours / vLLM (above 1: faster than vLLM)")
    assert list(vs_vllm) == ["FakeStaticEngine", "FakeSubmitEngine"]
    assert vs_vllm["FakeStaticEngine"] == pytest.approx([0.25, 0.25, 8.0, mixed_budget / 64 / 16], abs=0.0051)
    assert vs_vllm["FakeSubmitEngine"] == pytest.approx([0.625, 0.625, 20.0, mixed_budget / 25.6 / 16], abs=0.0051)
    vs_first = ratios("against FakeStaticEngine (above 1: faster than FakeStaticEngine)")
    assert list(vs_first) == ["FakeSubmitEngine", "vLLM"]
    assert vs_first["FakeSubmitEngine"] == pytest.approx([2.5] * 4, abs=0.0051)
    assert vs_first["vLLM"] == pytest.approx([4.0, 4.0, 0.125, 16 * 64 / mixed_budget], abs=0.0051)

    saved = json.loads(out.read_text())
    assert list(saved["workloads"]) == ["batch_1", "prefill", "batch_32", "mixed_32"]
    prefill = saved["workloads"]["prefill"]
    assert [r["stats"]["name"] for r in prefill["results"]] == ["FakeStaticEngine", "FakeSubmitEngine", "vLLM"]
    assert [r["stats"]["input_tokens"] for r in prefill["results"]] == [489, 489, 489]
    assert prefill["modes"]["FakeStaticEngine"] == "batch of 1"
    assert saved["workloads"]["batch_32"]["modes"]["FakeStaticEngine"] == "batch of 32"
    assert saved["summary"]["vs_peer"]["FakeSubmitEngine"]["batch_32"] == pytest.approx(20.0)
    assert saved["summary"]["vs_first"]["FakeStaticEngine"]["vLLM"]["prefill"] == pytest.approx(4.0)
    assert saved["config"]["workload"] == "table" and len(saved["config"]["peer"]["printed"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_table_without_a_peer_compares_with_the_first_engine_only(mixed_world, capsys):
    result = offline.main(["--workload", "table", "--ignore-eos", "--runs", "1", "--warmup", "0",
                           "--engine", "fake:FakeStaticEngine", "--engine", "fake:FakeSubmitEngine",
                           "--batch", "FakeStaticEngine"])
    assert result["summary"]["vs_peer"] == {} and list(result["summary"]["rows"]) == ["FakeStaticEngine",
                                                                                      "FakeSubmitEngine"]
    printed = capsys.readouterr().out
    assert "ours / vLLM" not in printed and "vLLM" not in printed
    assert summary_block(printed, "against FakeStaticEngine") == {"FakeSubmitEngine": ["2.50x"] * 4}


def test_table_keeps_a_peer_that_failed_midway_where_it_ran(mixed_world, fake_vllm, monkeypatch, capsys):
    peer_measure, runs = offline.peers.VllmPeer.measure, []

    def measure(self, items):   # vLLM runs batch 1, then fails on prefill
        runs.append(len(items))
        if len(runs) > 1:
            raise offline.peers.PeerFailed("vLLM exited with code 1: out of memory")
        return peer_measure(self, items)
    monkeypatch.setattr(offline.peers.VllmPeer, "measure", measure)
    result = offline.main(["--workload", "table", "--ignore-eos", "--runs", "1", "--warmup", "0",
                           "--engine", "fake:FakeSubmitEngine", "--model", fake_vllm["model"], "--peer", "vllm",
                           "--peer-venv", fake_vllm["venv"]])
    assert runs == [1, 1]                                   # not tried again on batch 32 and mixed 32
    assert result["summary"]["rows"]["vLLM"] == {"batch_1": 16.0, "prefill": None, "batch_32": None,
                                                 "mixed_32": None}
    printed = capsys.readouterr().out
    assert printed.count("vLLM failed, its row is left out: vLLM exited with code 1: out of memory") == 1
    assert summary_block(printed, "[Speed table")["vLLM"] == ["16.0", "-", "-", "-"]
    assert summary_block(printed, "ours / vLLM")["FakeSubmitEngine"][1:] == ["-", "-", "-"]
    vs_vllm = result["summary"]["vs_peer"]["FakeSubmitEngine"]
    assert vs_vllm["batch_1"] == pytest.approx(10 / 16) and list(vs_vllm.values())[1:] == [None] * 3


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "4"], "fixes every workload's requests, sizes and budgets: drop --num-prompts"),
    (["--max-new-tokens", "8", "--num-prompts", "2"], "drop --num-prompts, --max-new-tokens"),
    (["--batch", "--batch-size", "4"], "drop --batch-size"),
    (["--prompts", "other.json"], "drop --prompts"),
    (["--prefix-caching"], "would time a cache hit, not a prefill; drop --prefix-caching"),
])
def test_table_refuses_flags_that_would_change_its_workloads(argv, message, mixed_world, capsys):
    with pytest.raises(SystemExit):
        offline.main(["--engine", "fake:FakeEngine", "--workload", "table", "--ignore-eos"] + argv)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()[-1]) > len(message)


def test_table_on_the_tiny_model_counts_the_tokens_its_columns_are_defined_by(tiny_model_dir, monkeypatch):
    """The real engine and tokenizer see the prompt lengths the workloads were cut to. Batch 1 and
    prefill only: 32 requests of 128 tokens would take the tiny model many seconds, and their
    token counts are the builders' (test_table_workloads_have_exact_token_counts_and_budgets)."""
    from kit import suite

    monkeypatch.setattr(suite, "COLUMNS", suite.COLUMNS[:2])
    result = offline.main(["--model", str(tiny_model_dir), "--device", "cpu", "--workload", "table",
                           "--ignore-eos", "--runs", "1", "--warmup", "0", "--batch"])
    counted = {key: (m.stats[0].input_tokens, m.stats[0].output_tokens) for key, m in result["workloads"].items()}
    assert counted == {"batch_1": (committed_requests()[0]["prompt_tokens"], 128), "prefill": (489, 1)}
    prefill = result["workloads"]["prefill"].stats[0]
    assert result["summary"]["rows"]["BaselineEngine"]["prefill"] == 489 / prefill.duration_s


def test_table_needs_equal_work_and_is_offline_only(mixed_world, capsys):
    with pytest.raises(SystemExit):
        offline.main(["--engine", "fake:FakeEngine", "--workload", "table"])
    assert "its columns are defined by their budgets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_script("06_benchmark_online").main(["--workload", "table"])
    assert "invalid choice: 'table'" in capsys.readouterr().err
