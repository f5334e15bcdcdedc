"""scripts/results.py: medians and ranges of alternating runs, and a goal reached only where the whole
range clears it. The benchmark is replaced by known rates, so this takes no model and no time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "results.py"
spec = importlib.util.spec_from_file_location("results_script", SCRIPT)
results = sys.modules["results_script"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results)


def fake_bench(runs: list[dict[str, float]], seen: list):
    """The offline benchmark's --json for each run in turn: one row per engine, the given rates."""
    def bench(argv):
        seen.append(argv)
        rates = runs[len(seen) - 1]
        return {"results": [{"stats": {"name": n, "output_tokens_per_s": r}} for n, r in rates.items()],
                "summary": {"rows": {n: {"mixed_32": r, "batch_32": r} for n, r in rates.items()}}}
    return bench


def test_verdict_needs_the_whole_range_on_one_side():
    assert results.verdict([10.5, 11.0, 12.0], 10) == "reached"
    assert results.verdict([8.0, 9.0, 9.9], 10) == "not reached"
    assert results.verdict([9.0, 10.5, 11.0], 10).startswith("not shown")
    assert results.verdict([1.0, 2.0, 3.0], None) == "(no goal)"


@pytest.fixture(autouse=True)
def quick_stamp(monkeypatch):
    """The capture stamp, without importing torch and the package for its version (seconds)."""
    monkeypatch.setattr(results, "stamp", lambda threads, before, after:
                        f"[captured on a test machine, {threads} torch thread(s); load average {before:.1f}]\n")


def test_a_sitting_reports_medians_ranges_and_ratios_of_each_run(tmp_path):
    runs = [{"BaselineEngine": 10.0, "StaticBatchEngine": 20.0, "LLM": 50.0},
            {"BaselineEngine": 5.0, "StaticBatchEngine": 9.0, "LLM": 30.0},     # a loaded moment hits all three
            {"BaselineEngine": 8.0, "StaticBatchEngine": 17.0, "LLM": 44.0}]
    seen, out = [], tmp_path / "results.txt"
    assert results.main(["--only", "Chapter 9", "--out", str(out)], bench=fake_bench(runs, seen)) == 0
    assert len(seen) == 3 and all("--runs" in a and a[a.index("--runs") + 1] == "1" for a in seen)
    assert "--num-prompts" in seen[0] and seen[0][seen[0].index("--num-prompts") + 1] == "8"   # the quick sitting
    text = out.read_text()
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "BaselineEngine 8.00 [5.00 to 10.00] tokens/s" in lines
    # Ratios within each run (5.0, 6.0, 5.5 and 2.5, 3.33, 2.59), then their median and range.
    assert "continuous / one at a time (HF) 5.50x [5.00 to 6.00] goal 10x: not reached" in lines
    assert "continuous / static batch 2.59x [2.50 to 3.33] goal 2x: reached" in lines
    assert lines[-1].startswith("[captured ") and "torch thread" in lines[-1] and "load average" in lines[-1]


def test_vllm_ratios_wait_for_peers_and_read_its_row(tmp_path):
    seen, out = [], tmp_path / "results.txt"
    results.main(["--out", str(out), "--only", "Chapters 1 and 13"], bench=fake_bench([], seen))
    assert seen == []   # an entry that only compares with vLLM is skipped without --peers
    runs = [{"LLM": 100.0, "vLLM": 150.0}, {"LLM": 90.0, "vLLM": 160.0}, {"LLM": 110.0, "vLLM": 150.0}]
    results.main(["--out", str(out), "--only", "Chapters 1 and 13", "--peers"], bench=fake_bench(runs, seen))
    assert all(a[-2:] == ["--peer", "vllm"] for a in seen)
    assert "vLLM / ours 1.50x [1.36 to 1.78] (no goal)" in [" ".join(x.split()) for x in out.read_text().splitlines()]


def test_fewer_than_three_runs_are_refused():
    with pytest.raises(SystemExit):
        results.main(["--runs", "2"], bench=lambda argv: {})


def test_a_capture_stamp_names_the_thread_count_its_command_asks_for():
    sys.path.insert(0, str(SCRIPT.parent))
    import capture_outputs

    assert capture_outputs.threads_of(["OMP_NUM_THREADS=2 python 06_benchmark_offline.py"]) == 2
    assert capture_outputs.threads_of(["python 17_compile.py --threads 1 --glue"]) == 1
    assert capture_outputs.threads_of(["python 01_setup.py"]) is None   # torch's default, said by the stamp
