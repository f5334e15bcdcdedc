"""minivllm as a user of the library meets it: imported from any folder, `LLM` with vLLM's
calls, closed by a `with` block, and no web framework loaded on the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_elsewhere(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Python started in an empty folder: the package must come from the install, not the cwd."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_importing_the_engine_loads_no_web_framework_and_no_script(tmp_path):
    done = run_elsewhere("import sys, minivllm, minivllm.llm\n"
                         "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'kit') if m in sys.modules))",
                         tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_llm_from_another_folder_generates_chats_and_closes(tmp_path, tiny_model_dir):
    code = f"""
import threading, json
from minivllm import LLM, SamplingParams
before = threading.active_count()
with LLM({str(tiny_model_dir)!r}, kv_memory=8 << 20) as llm:
    one = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    many = llm.generate(["Hello", "Hi there"], SamplingParams(max_tokens=3, ignore_eos=True))
    chat = llm.chat([{{"role": "user", "content": "Hi"}}], SamplingParams(max_tokens=2, ignore_eos=True))
    default = llm.generate("Hello", SamplingParams(ignore_eos=True, max_tokens=None))
print(json.dumps([one.metrics.output_tokens, [r.metrics.output_tokens for r in many],
                  chat.metrics.output_tokens, default.metrics.output_tokens, threading.active_count() - before]))
"""
    done = run_elsewhere(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    one, many, chat, default, threads_left = json.loads(done.stdout.strip().splitlines()[-1])
    assert (one, many, chat) == (4, [3, 3], 2)
    from minivllm.llm import DEFAULT_MAX_TOKENS
    assert default == DEFAULT_MAX_TOKENS      # neither argument given: the documented default
    assert threads_left == 0                  # the engine loop ended with the block


def test_llm_refuses_bad_options_before_loading_anything(tmp_path):
    from minivllm import LLM
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tmp_path / "no-such-model"), block_size=0)
    with pytest.raises(ValueError, match="quant"):
        LLM(str(tmp_path / "no-such-model"), quant="int3")


def test_console_scripts_point_at_functions_that_exist():
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    from kit import console
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert module == "kit.console" and callable(getattr(console, function)), name
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['minivllm-bench', '--help'];"
                           "from kit.console import bench; bench()"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "--engine" in done.stdout, done.stderr[-2000:]


def test_a_pool_too_small_for_one_block_is_refused_before_the_weights_load(tiny_model_dir, monkeypatch):
    from minivllm import LLM, llm

    loaded = []
    monkeypatch.setattr(llm, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(ValueError, match="less than one block"):
        LLM(str(tiny_model_dir), device="cpu", kv_memory=1)
    assert loaded == []


def test_the_default_precision_is_bfloat16_on_a_gpu_and_float32_elsewhere():
    import torch

    from minivllm.model_files import pick_dtype

    assert pick_dtype(None, "cpu") is torch.float32 and pick_dtype("auto", torch.device("cpu")) is torch.float32
    assert pick_dtype(None, "cuda") is torch.bfloat16 and pick_dtype("auto", "cuda:1") is torch.bfloat16
    assert pick_dtype("float16", "cuda") is torch.float16 and pick_dtype(torch.bfloat16, "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        pick_dtype("float64", "cpu")


def test_every_engine_takes_dtype_by_name(tiny_model_dir):
    """--dtype reaches any engine through the same keyword: the server, both benchmarks and the
    engine scripts pass the name; the engine resolves it where its weights load."""
    import torch

    from kit.engines import load_engine

    for spec in ("04_engine:BaselineEngine", "10_model_engine:ModelEngine", "minivllm:LLM"):
        engine = load_engine(spec, str(tiny_model_dir), device="cpu", dtype="bfloat16")
        try:
            model = engine.model if spec != "minivllm:LLM" else engine.runner.model
            assert next(iter(p for p in model.parameters())).dtype is torch.bfloat16 if hasattr(model, "parameters") \
                else model.dtype is torch.bfloat16, spec
            assert engine.generate("Hello", 3, None).metrics.output_tokens >= 1
        finally:
            getattr(engine, "close", lambda: None)()
