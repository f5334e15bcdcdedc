"""Shared fixtures: the numbered scripts as modules, a tiny random model, the real model.

Unit tests use `tiny_model_dir`: a 2-layer Llama with random weights but the real
SmolLM2 tokenizer, so tokenization, chat templates and EOS behave as in the real
thing while a forward pass costs microseconds. Tests marked `real_model` load the
default model itself (provisioned offline by 01_setup.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def step_by_step_logits(model, ids: list[int], n_prompt: int):
    """Chapter 6's model on its contiguous KVCache: prefill the first n_prompt ids (every
    position's logits), then feed the rest one decode step at a time. The reference that the
    model's own tests and the paged cache's tests compare against."""
    import torch

    from minivllm.batch import RaggedBatch

    cache = model.new_cache(1, len(ids))
    out = [model.forward(RaggedBatch.build([ids[:n_prompt]], [0], [0], len(ids)), cache, all_logits=True)]
    for t in range(n_prompt, len(ids)):
        out.append(model.forward(RaggedBatch.build([[ids[t]]], [0], [t], len(ids)), cache))
    return torch.cat(out)


def run_child(code: str, timeout: float, stderr_tail: int = 3000) -> dict:
    """Run `code` in a fresh Python on one torch thread; return the JSON of its `RESULT ` line
    (a process of its own: its own process group, its own children to count)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-stderr_tail:]
    return json.loads(lines[0][len("RESULT "):])


def load_script(name: str):
    """Import a numbered script such as '04_engine' as a module."""
    return importlib.import_module(name)


class Parsed(Exception):
    """Raised instead of parsing: carries the parser a script's main() built."""

    def __init__(self, parser):
        self.parser = parser


def parser_of(script: str, monkeypatch) -> argparse.ArgumentParser:
    """The argument parser a script's main() builds, caught before it parses anything (the
    patch is undone before returning, so the test may parse with it)."""
    def catch(self, *args, **kwargs):
        raise Parsed(self)
    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(Parsed) as caught:
            load_script(script).main()
    return caught.value.parser


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from a second thread, and on a busy 2-core machine the threads'
    spin-waits make them many times slower: one thread for a test file that asks
    (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`), restored afterwards."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def setup_mod():
    return load_script("01_setup")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from minivllm.model_files import DEFAULT_MODEL, resolve_model

    return Path(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A randomly initialised 2-layer Llama saved as an HF folder, with the real tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine_mod():
    return load_script("04_engine")


@pytest.fixture(scope="session")
def tiny_engine(engine_mod, tiny_model_dir):
    return engine_mod.BaselineEngine(str(tiny_model_dir), device="cpu",
                                     structured_output=importlib.import_module("minivllm.structured").StructuredOutput())


@pytest.fixture(scope="session")
def real_engine(engine_mod, default_model_dir):
    return engine_mod.BaselineEngine(str(default_model_dir), device="cpu")


@pytest.fixture(scope="session")
def reference_prompts() -> list[str]:
    from kit import workloads

    return workloads.reference_prompts()
