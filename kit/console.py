"""kit/console.py - `minivllm-serve` and `minivllm-bench`: the server and the offline benchmark
from any folder, once the repository is installed (`pip install -e .`).

Both are numbered scripts of Chapter 1 (05_server.py, 06_benchmark_offline.py), whose names
start with a digit and so cannot be imported by name; these entry points run them from the
repository this package was installed from, with the command line as given.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


CLASSROOM_ENGINE = "minivllm:LLM"   # the batching engine: a class of students share its steps


def _run(script: str) -> None:
    path = REPO_ROOT / script
    if not path.is_file():
        raise SystemExit(f"{script} is not next to {Path(__file__).parent}: these commands run the "
                         "repository's scripts, so install it editable (`pip install -e .` in the clone)")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))   # the scripts import each other and kit by name
    sys.argv[0] = str(path)
    runpy.run_path(str(path), run_name="__main__")


def serve() -> None:
    """minivllm-serve [flags of 05_server.py]: an OpenAI-compatible server on 127.0.0.1, serving the
    assembled, batching engine (minivllm:LLM) unless --engine or $ENGINE_CLASS names another. (05_server.py's
    own default stays Chapter 1's engine, the one its chapter teaches.)"""
    named = any(arg == "--engine" or arg.startswith("--engine=") for arg in sys.argv[1:])
    if not named and not os.environ.get("ENGINE_CLASS"):
        sys.argv[1:1] = ["--engine", CLASSROOM_ENGINE]
    _run("05_server.py")


def bench() -> None:
    """minivllm-bench [flags of 06_benchmark_offline.py]: one engine, or several, on one workload."""
    _run("06_benchmark_offline.py")
