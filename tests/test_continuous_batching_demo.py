"""13_continuous_batching_demo: the trace and the timelines say what the scheduler really did (tiny model)."""

from __future__ import annotations

import time

import pytest

from conftest import load_script
from kit.workloads import WorkItem, mixed_workload
from minivllm.contracts import SamplingParams

demo = load_script("13_continuous_batching_demo")
GREEDY = SamplingParams(ignore_eos=True)      # a random model's EOS would end requests at random


def make_engine(model_dir, kv_memory=2 << 20):     # 4,096 tokens of the tiny model: room for everything
    return demo.TracedEngine(str(model_dir), device="cpu", kv_memory=kv_memory, max_num_seqs=4,
                             max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    yield engine
    engine.close()                                   # ends its engine loop thread


@pytest.fixture(scope="module")
def workload(engine):
    items = [WorkItem(it.prompt, 3 + i % 4) for i, it in enumerate(mixed_workload(engine.tokenizer, 6))]
    return items, demo.arrival_times(len(items), rate=200.0, seed=0)


@pytest.fixture(scope="module")
def roomy(engine, workload):
    return demo.run_continuous(engine, *workload, GREEDY)


def prompt_len(engine, item):
    return len(engine.tokenizer(item.prompt).input_ids)


def check_trace(run, engine, items):
    """Every request is admitted once plus once per preemption, fed its tokens in order, and leaves once."""
    ids = {label: rid for rid, label in run["labels"].items()}
    for i, (item, req) in enumerate(zip(items, run["requests"])):
        rid = ids[f"r{i}"]
        admitted = [s["step"] for s in run["steps"] for c in s["chunks"] if c[:2] == (rid, 0)]
        preempted = [s["step"] for s in run["steps"] if rid in s["preempted"]]
        finished = [s["step"] for s in run["steps"] if rid in s["finished"]]
        assert len(admitted) == 1 + req["preemptions"] == 1 + len(preempted)
        assert len(finished) == 1 and finished[0] > admitted[-1] - 1
        assert all(a < p for a, p in zip(admitted, preempted))           # preempted only after admission
        # After its last admission the chunks cover tokens 0..(prompt + tokens so far) without gaps.
        chunks = [c for s in run["steps"] if s["step"] >= admitted[-1] for c in s["chunks"] if c[0] == rid]
        assert chunks[0][1] == 0 and all(a[2] == b[1] for a, b in zip(chunks, chunks[1:]))
        assert chunks[-1][2] == chunks[-1][3] >= prompt_len(engine, item)
        assert len(req["ids"]) == item.max_new_tokens                      # ignore_eos: the whole budget
    for s in run["steps"]:
        assert s["tokens"] == s["decodes"] + sum(b - a for _, a, b, _ in s["chunks"]) <= 32
        assert s["running"] <= 4 and s["t0"] <= s["t1"]
    assert run["steps"][-1]["free"] == engine.blocks.num_blocks            # nothing left allocated


def check_segments(run):
    """Each request's timeline starts at its arrival, runs forward without overlaps, and ends at its last token."""
    for req in run["requests"]:
        segs = req["segments"]
        assert segs[0][0] == "waiting" and segs[0][1] == req["arrival"]
        assert all(a <= b for _, a, b in segs)
        assert all(x[2] <= y[1] + 1e-9 for x, y in zip(segs, segs[1:]))
        assert {k for k, _, _ in segs} <= set(demo.COLORS)
        work = [s for s in segs if s[0] in ("prefill", "decode")]
        assert work[-1][2] >= req["last"] - 1e-3 and req["first"] <= req["last"]


def test_trace_is_consistent_with_the_scheduler(engine, workload, roomy):
    items = workload[0]
    check_trace(roomy, engine, items)
    check_segments(roomy)
    assert any(b < known for s in roomy["steps"] for _, _, b, known in s["chunks"]), \
        "a 32-token budget must split the longer prompts into chunks"
    assert not any(s["preempted"] for s in roomy["steps"])


def test_preemption_shows_in_the_trace_and_changes_no_output(engine, tiny_model_dir, workload):
    # Budgets of 40: the first two prompts (48 and 95 tokens) are admitted into 9 blocks, then
    # outgrow a pool one block larger than the longest request needs. All arrive at once: with
    # the workload's few-millisecond gaps a fast machine finished r0 before r1 came.
    items, arrivals = [WorkItem(it.prompt, 40) for it in workload[0]], [0.0] * len(workload[0])
    per_block = engine.model.config.kv_bytes_per_token(engine.model.dtype) * engine.pool.block_size
    longest = max(prompt_len(engine, it) + it.max_new_tokens for it in items)
    tight = make_engine(tiny_model_dir, kv_memory=(engine.blocks.blocks_for(longest) + 1) * per_block)
    run = demo.run_continuous(tight, items, arrivals, GREEDY)
    assert any(s["preempted"] for s in run["steps"])
    check_trace(run, tight, items)
    check_segments(run)
    assert any(k == "preempted" for req in run["requests"] for k, _, _ in req["segments"])
    tight.close()
    alone = demo.run_continuous(engine, items, arrivals, GREEDY)
    assert [r["ids"] for r in run["requests"]] == [r["ids"] for r in alone["requests"]]


def test_the_step_clock_gives_the_same_schedule_however_long_steps_take(engine, workload, monkeypatch):
    """--clock steps: request i arrives at the end of step floor(t_i / step_s), so a slow machine
    (here: every step 30 ms longer) admits the same requests in the same steps."""
    items = workload[0]
    arrivals = [0.0, 0.5, 0.6, 1.2, 9.0, 9.1]                  # due after steps 0, 2, 2, 4, 36, 36

    def schedule(run):                                            # request ids differ between runs: labels
        name = run["labels"].get
        return [(s["step"], [(name(c[0]), *c[1:]) for c in s["chunks"]], s["decodes"], list(map(name, s["finished"])),
                 s["free"], s["waiting"]) for s in run["steps"]]

    fast = demo.run_continuous(engine, items, arrivals, GREEDY, step_s=0.25)
    real_step = engine.runner.step
    monkeypatch.setattr(engine.runner, "step", lambda *a: time.sleep(0.03) or real_step(*a))
    slow = demo.run_continuous(engine, items, arrivals, GREEDY, step_s=0.25)
    assert schedule(fast) == schedule(slow)
    check_trace(slow, engine, items)
    check_segments(slow)
    ids = {label: rid for rid, label in slow["labels"].items()}
    admitted = {label: next(s["step"] for s in slow["steps"] for c in s["chunks"] if c[:2] == (rid, 0))
                for label, rid in ids.items()}
    assert admitted["r0"] == 1 and admitted["r1"] == 3                         # it joins the step after
    done = max(s["step"] for s in slow["steps"] for rid in s["finished"] if rid in [ids[f"r{i}"] for i in range(4)])
    assert done < 36 and admitted["r4"] == done + 1                            # an idle engine skips ahead
    assert slow["arrivals"] == sorted(slow["arrivals"]) and slow["arrivals"][0] < 0.05   # when handed over


def test_static_and_sequential_timelines(tiny_model_dir, workload, roomy):
    static = load_script("09_static_batching").StaticBatchEngine(str(tiny_model_dir), device="cpu")
    items, arrivals = workload
    for size in (3, 1):
        run = demo.run_fifo(static, items, arrivals, GREEDY, size, "static")
        check_segments(run)
        assert [r["ids"] for r in run["requests"]] == [r["ids"] for r in roomy["requests"]]
        ends = [r["segments"][-1][2] for r in run["requests"]]
        assert len(set(ends)) >= len(items) / size                        # one end per batch
        for req in run["requests"]:                                       # contiguous: a batch is never idle
            assert all(abs(x[2] - y[1]) < 1e-9 for x, y in zip(req["segments"], req["segments"][1:]))
        stats = demo.summary(run)
        assert stats["tokens"] == sum(it.max_new_tokens for it in items) and stats["tokens_per_s"] > 0


def test_main_prints_the_trace_and_draws_the_plot(tiny_model_dir, tmp_path, capsys):
    png = tmp_path / "timeline.png"
    out = demo.main(["--model", str(tiny_model_dir), "--requests", "3", "--rate", "100", "--output-scale", "0.05",
                     "--max-num-batched-tokens", "64", "--kv-memory", "2MB", "--plot", str(png)])
    text = capsys.readouterr().out
    for header in ("[Workload]", "[Trace]", "[Requests]", "[Same requests, same arrivals]", "[Plot]"):
        assert header in text
    assert [r["name"] for r in out["runs"]] == ["continuous", "static", "sequential"]
    assert png.stat().st_size > 10_000


def test_flags(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0 and "--max-num-batched-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="memory size"):
        demo.main(["--model", str(tiny_model_dir), "--kv-memory", "lots"])
    with pytest.raises(SystemExit):
        demo.main(["--requests", "0"])
    with pytest.raises(SystemExit, match="no request fits"):
        demo.main(["--model", str(tiny_model_dir), "--kv-memory", "8KB", "--requests", "2"])


def test_the_switches_header_names_only_what_every_engine_shares():
    switches = load_script("13_continuous_batching_switches")
    features = [{"engine": "CB", "quant": "float32", "prefix_caching": False, "block_size": 16},
                {"engine": "CB", "quant": "int8", "prefix_caching": True, "block_size": 16},
                {"engine": "CB", "quant": "int4", "prefix_caching": False, "block_size": 16}]
    common, differing = switches.shared_features(features)
    assert common == {"engine": "CB", "block_size": 16} and differing == ["quant", "prefix_caching"]
    with pytest.raises(ValueError):
        switches.shared_features([])
