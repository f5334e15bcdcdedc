"""The exercises' harness: one switch decides whose answers the checks read.

    pytest exercises                         your answers: exercises/chNN/answers.py
    pytest exercises/ch07                    one chapter
    EXERCISES=solutions pytest exercises     the shipped solutions: exercises/chNN/solutions/answers.py

Every chapter's test file asks for the `answers` fixture and checks what it finds there against
the real parts of the engine (minivllm, the numbered scripts), run on the tests' tiny random
model with the real tokenizer. The starters raise NotImplementedError or hold None, so on a fresh
clone every chapter fails until its answers are written.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# The tests' own fixtures, one definition: a 2-layer random Llama with SmolLM2's tokenizer.
from tests.conftest import default_model_dir, tiny_model_dir  # noqa: E402,F401

MODES = {"answers": Path("answers.py"), "solutions": Path("solutions") / "answers.py"}


def mode() -> str:
    chosen = os.environ.get("EXERCISES", "answers")
    if chosen not in MODES:
        raise pytest.UsageError(f"EXERCISES must be one of {sorted(MODES)}, got {chosen!r}")
    return chosen


def load_answers(chapter_dir: Path):
    """The answers module of one chapter folder, under a name of its own (every chapter's file is
    called answers.py)."""
    path = chapter_dir / MODES[mode()]
    name = f"exercise_{chapter_dir.name}_{mode()}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def answers(request):
    return load_answers(Path(request.path).parent)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny matmuls gain nothing from threads; on a shared machine the spin-waits cost a lot."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def pytest_report_header(config):
    return f"exercises: checking {mode()} ({'EXERCISES=solutions' if mode() == 'solutions' else 'your answers.py'})"
