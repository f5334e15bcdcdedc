"""Chapter 14: tensor parallelism. N = 2 processes (gloo on CPU) against one, on the tiny model;
N = 3 on the default model (its 9 heads and 3 KV heads do not split in 2).

One tensor-parallel engine per module: spawning the workers and loading the model is the cost."""

from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

from conftest import REPO_ROOT, load_script, run_child
from kit.workloads import reference_prompts
from minivllm import LLM, LoRARequest
from minivllm.contracts import SamplingParams
from minivllm.quantization import WeightFormat
from minivllm.speculative import SpeculativeDecoding
from test_lora import make_adapter
from test_server_continuous import body_for, text_of

server = load_script("05_server")
launcher = importlib.import_module("kit.launcher")
SPEC = "minivllm:LLM"

KV = 8 << 20
PROMPTS = reference_prompts() + ["One, two, three,"]          # 8 requests


# Both serve adapters (Chapter 17), so that the group's cost is paid once; a request without one
# runs the base alone, as in an engine without them. The group has one slot: adapters take turns.
ADAPTERS = dict(enable_lora=True, max_lora_rank=8)


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=KV, max_num_seqs=8, max_loras=2, **ADAPTERS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def parallel(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=KV, max_num_seqs=8,
                 tensor_parallel_size=2, max_loras=1, **ADAPTERS)
    yield engine
    engine.close()     # the workers too


def prefill_logits(engine, prompts: list[str]) -> torch.Tensor:
    """The last-token logits of every prompt's prefill, in one ragged step through the engine's runner
    (on N ranks: rank 0 broadcasts the step, as in every step, and gets the gathered logits)."""
    requests = [engine.new_request(p, 4) for p in prompts]
    try:
        for r in requests:
            engine.blocks.allocate_prompt(r.id, r.prompt_ids)
        args = (requests, [0] * len(requests), [r.num_tokens for r in requests],
                [engine.blocks.tables[r.id] for r in requests])
        return engine.runner.forward(*args)
    finally:
        for r in requests:
            engine.blocks.free(r.id)


def test_logits_within_1e_4_of_one_process(single, parallel):
    one, two = prefill_logits(single, PROMPTS), prefill_logits(parallel, PROMPTS)
    assert one.shape == two.shape == (len(PROMPTS), single.model.config.vocab_size)
    assert (one - two).abs().max().item() < 1e-4


def test_greedy_identical_for_8_concurrent_requests(single, parallel):
    params = SamplingParams(ignore_eos=True)
    one = single.generate_batch(PROMPTS, 12, params)
    parallel.recent_batches.clear()
    two = parallel.generate_batch(PROMPTS, 12, params)
    assert [r.output_ids for r in two] == [r.output_ids for r in one]
    assert max(parallel.recent_batches) > 1, "the requests never shared a step"


def test_speculative_verification_runs_on_every_rank(single, parallel):
    """Chapter 10 on Chapter 14: a verification feeds k + 1 tokens and wants their logits; the
    workers must compute the same rows, or the LM head's all-gather would not match."""
    plain = parallel.runner
    parallel.runner = SpeculativeDecoding("draft", 4).build(   # this model on int4, on rank 0
        plain, parallel.folder, KV, parallel.pool.block_size, [WeightFormat("int4", 32)])
    try:
        draft = parallel.speculator.proposer.runner   # the whole draft model, on a pool of the budget asked for
        assert draft.model.config == single.model.config and draft.kv.num_blocks == single.pool.num_blocks
        params = SamplingParams(ignore_eos=True)
        one, two = single.generate_batch(PROMPTS[:4], 16, params), parallel.generate_batch(PROMPTS[:4], 16, params)
        assert [r.output_ids for r in one] == [r.output_ids for r in two]
        assert sum(r.metrics.accepted_tokens or 0 for r in two) > 0
    finally:
        parallel.runner = plain


def test_adapters_split_over_the_ranks_answer_as_one_process(single, parallel, tiny_model_dir, tmp_path):
    """Chapter 17 on Chapter 14. q, k, v, gate, up: A whole on every rank, B's rows split as the
    weight's; o, down: A's columns split, B whole, the partial sums added before the base's one
    all-reduce. Two adapters and the base in one batch, on one slot: rank 0 swaps the adapters
    in turn and the other rank follows, reading its own share from each adapter's folder."""
    loras = [LoRARequest(f"a{seed}", seed, str(tmp_path / f"a{seed}")) for seed in (1, 2)]
    for lora in loras:
        make_adapter(tiny_model_dir, lora.lora_path, lora.lora_int_id)
    params, rows = SamplingParams(max_tokens=8, ignore_eos=True), [loras[0], None, loras[1]]
    one = [r.output_ids for r in single.generate(PROMPTS[:3], params, lora_request=rows)]
    swaps = parallel.lora.num_swaps
    two = [r.output_ids for r in parallel.generate(PROMPTS[:3], params, lora_request=rows)]
    assert two == one
    assert one[0] != single.generate(PROMPTS[0], params).output_ids      # the adapter changed the answer
    assert parallel.lora.num_swaps - swaps >= 2 and parallel.runner.features()["lora"]["max_loras"] == 1


def test_server_with_8_concurrent_clients(single, parallel):
    requests = [body_for(i) for i in range(8)]

    async def answers(engine):
        transport = httpx.ASGITransport(app=server.make_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            responses = await asyncio.gather(*(client.post(p, json=b) for p, b in requests))
        return [text_of(p, b, r) for (p, b), r in zip(requests, responses)]

    assert asyncio.run(answers(parallel)) == asyncio.run(answers(single))


def test_each_rank_holds_1_over_n_of_layers_and_the_kv_budget_of_one(single, parallel):
    """kv_memory is each rank's, as vLLM sizes each worker's pool: a block holds half the KV heads,
    so the same bytes hold twice the blocks, and two ranks hold twice the tokens of one process."""
    assert parallel.pool.num_blocks == 2 * single.pool.num_blocks == parallel.blocks.num_blocks
    stats = parallel.runner.rank_stats()
    full, c = single.model, single.model.config
    norms = sum(t.numel() * t.element_size() for name, t in full.w.items() if "norm" in name)
    assert [s["rank"] for s in stats] == [0, 1] and len({s["pid"] for s in stats}) == 2
    for s in stats:
        assert s["weight_bytes"] - norms == (full.weight_bytes - norms) // 2   # every matrix split, norms kept
        assert s["kv_bytes"] == single.pool.nbytes                       # the budget of one, per rank
        assert (s["heads"], s["kv_heads"]) == (c.num_heads // 2, c.num_kv_heads // 2)


def test_an_indivisible_head_count_is_refused_before_any_process_starts(tiny_model_dir):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads and 2 KV heads"):
        LLM(str(tiny_model_dir), device="cpu", tensor_parallel_size=3)
    assert multiprocessing.active_children() == before


CHILD = textwrap.dedent("""
    import importlib, sys, time
    sys.path.insert(0, {root!r})
    from minivllm import LLM
    engine = LLM({model!r}, device="cpu", kv_memory=8 << 20, tensor_parallel_size=2)
    print("PIDS", *[s["pid"] for s in engine.runner.rank_stats()], flush=True)
    while True:
        engine.generate("Count to ten:", 8)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_killed_worker_ends_the_server_and_leaves_nobody_behind(tiny_model_dir, tmp_path):
    options = {"tensor_parallel_size": 2, "kv_memory": KV}
    cmd = launcher.server_command(launcher.free_port(), str(tiny_model_dir), SPEC, "cpu", options)
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert launcher.wait_until_healthy(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", proc, 180)
        out.seek(0)
        worker = int(re.search(r"worker pids \[(\d+)\]", out.read()).group(1))
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=10) == 1   # within 10 s of the kill, non-zero: a supervisor restarts it
        err.seek(0)
        last = err.read().strip().splitlines()[-1]
        assert f"tensor-parallel worker tp-rank-1 (pid {worker}) exited with code -9" in last, last
        assert wait_gone([proc.pid, worker]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dying_worker_ends_the_streams_with_an_error_and_refuses_new_requests(tiny_model_dir, tmp_path):
    """Killed mid-stream, a worker takes the group down, but not silently: every stream in flight
    gets an error event and [DONE], a request sent meanwhile a 503, then the server exits 1."""
    port = launcher.free_port()
    cmd = launcher.server_command(port, str(tiny_model_dir), SPEC, "cpu",
                                  {"tensor_parallel_size": 2, "kv_memory": KV})
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        assert launcher.wait_until_healthy(url, proc, 60)
        out.seek(0)
        worker = int(re.search(r"worker pids \[(\d+)\]", out.read()).group(1))
        body = {"prompt": "Tell me a long story.", "max_tokens": 480, "ignore_eos": True, "stream": True}
        events = []
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            os.kill(worker, signal.SIGKILL)   # mid-stream
            late = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        assert late.status_code == 503 and "unavailable" in late.json()["error"]["message"], late.text
        assert proc.wait(timeout=20) == 1
        assert wait_gone([proc.pid, worker]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_step_that_finds_the_group_gone_refuses_every_later_request(tiny_model_dir):
    """The step can see the group fail before the watcher does: the runner says the engine is
    unavailable (the server's 503), not a bare RuntimeError (a 500), and the loop refuses what
    comes next with the same error, whichever of the two noticed first."""
    from minivllm.engine_loop import EngineUnavailable
    from minivllm.parallel_workers import TensorParallelRunner
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=KV, max_num_seqs=8)
    gone = TensorParallelRunner(engine.runner.model, engine.runner.kv, None, None)
    gone.closed = True                                   # the group went away before this step
    engine.runner = gone
    try:
        with pytest.raises(EngineUnavailable, match="tensor-parallel group is closed"):
            engine.generate("Hello", 4)
        with pytest.raises(EngineUnavailable):
            engine.submit("Hello again", 4)
    finally:
        engine.close()


def test_a_killed_rank_0_takes_its_workers_with_it(tiny_model_dir):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(REPO_ROOT), model=str(tiny_model_dir))],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = child.stdout.readline()
        while line and not line.startswith("PIDS"):
            line = child.stdout.readline()
        assert line.startswith("PIDS")
        parent, worker = map(int, line.split()[1:])
        assert parent == child.pid
        os.kill(parent, signal.SIGKILL)
        child.wait(timeout=20)
        assert wait_gone([worker]) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


REAL = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import test_tensor_parallel as t
    prompts, params, out = t.PROMPTS[:7], t.SamplingParams(), {{}}
    one = t.LLM({model!r}, device="cpu", kv_memory=64 << 20)
    logits, expected = t.prefill_logits(one, prompts), one.generate_batch(prompts, 8, params)
    one.close()
    try:
        t.LLM({model!r}, device="cpu", tensor_parallel_size=2)
    except ValueError as exc:
        out["refused"] = str(exc)
    three = t.LLM({model!r}, device="cpu", kv_memory=64 << 20, tensor_parallel_size=3)
    out["diff"] = (t.prefill_logits(three, prompts) - logits).abs().max().item()
    out["same"] = [r.output_ids for r in three.generate_batch(prompts, 8, params)] == [r.output_ids for r in expected]
    three.close()
    print("RESULT", json.dumps(out))
""")


@pytest.mark.real_model
def test_default_model_on_3_processes_matches_one(default_model_dir):
    """In a process of its own: one process holds one group, and this module's engine holds one."""
    code = REAL.format(root=str(REPO_ROOT), tests=str(REPO_ROOT / "tests"), model=str(default_model_dir))
    out = run_child(code, timeout=300, stderr_tail=2000)
    assert "sizes that fit: 1, 3" in out["refused"]
    assert out["diff"] < 1e-4
    assert out["same"]
