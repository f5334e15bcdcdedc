"""compare_trees.py - the same benchmark on two checkouts of this repository, in alternating rounds.

Did a change slow the engine down? Run each case on the checkout before and the one after,
one fresh process per run, alternating before/after so that a busy machine slows both alike,
and report the median tokens/s of each and their ratio.

    git worktree add ../before <commit>
    python scripts/compare_trees.py ../before .                       # the four default cases
    python scripts/compare_trees.py ../before . --rounds 1 --case "float32 batch 1"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINE = "minivllm:LLM"   # a spec both checkouts know
CASES = {
    "float32 batch 1": ["--num-prompts", "1", "--runs", "3", "--max-new-tokens", "64"],
    "int4 batch 1": ["--num-prompts", "1", "--runs", "3", "--max-new-tokens", "64", "--quant", "int4"],
    "float32 mixed 32": ["--workload", "mixed"],
    "int4 mixed 32": ["--workload", "mixed", "--quant", "int4"],
}


def tokens_per_s(tree: Path, flags: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "06_benchmark_offline.py", "--engine", ENGINE, "--ignore-eos", "--warmup", "1",
               "--json", str(out), *flags]
        done = subprocess.run(cmd, cwd=tree, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{tree}: {' '.join(cmd[1:])} failed:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())["results"][0]["stats"]["output_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs per case (default 2)")
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="only these cases")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rows = []
    for name in args.case or CASES:
        got: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for side in ("before", "after"):
                got[side].append(tokens_per_s(getattr(args, side), CASES[name]))
                print(f"{name:18} round {r + 1} {side:6} {got[side][-1]:7.1f} tokens/s", flush=True)
        rows.append((name, statistics.median(got["before"]), statistics.median(got["after"])))
    print(f"\n{'case':18} {'before tok/s':>13} {'after tok/s':>12} {'after/before':>13}")
    for name, before, after in rows:
        print(f"{name:18} {before:13.1f} {after:12.1f} {after / before:13.2f}")


if __name__ == "__main__":
    main()
