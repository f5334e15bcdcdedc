"""kit/console.py - `minivllm-serve` and `minivllm-bench`: the server and the offline benchmark
from any folder, once the repository is installed (`pip install -e .`).

Both are numbered scripts of Chapter 1 (05_server.py, 06_benchmark_offline.py), whose names
start with a digit and so cannot be imported by name; these entry points run them from the
repository this package was installed from, with the command line as given.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


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
    """minivllm-serve [flags of 05_server.py]: an OpenAI-compatible server on 127.0.0.1."""
    _run("05_server.py")


def bench() -> None:
    """minivllm-bench [flags of 06_benchmark_offline.py]: one engine, or several, on one workload."""
    _run("06_benchmark_offline.py")
