"""Features that stack, checked on the real model: each combination's greedy tokens against its
plain counterpart on the reference prompts, and no process left once the engine is closed.

    python scripts/check_stacking.py                 # the default model, 3 ranks where it splits
    python scripts/check_stacking.py --tokens 16 --only int8-tp3

The tests check the same on the tiny model (tests/test_stacking.py); this is the slower check
on SmolLM2-135M, whose 9 heads and 3 KV heads split over 1 or 3 processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kit.engines import DEFAULT_ENGINE, load_engine  # noqa: E402
from kit.workloads import reference_prompts  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402

# name -> (the combination, its plain counterpart, exact?). Float32 combinations must give the
# counterpart's tokens exactly. Quantised kernels return bf16 partial results, and torch's int4
# kernel tiles differently by batch size, so a quantised combination is held to agreement, shown
# beside the quantised kernel's own disagreement with itself (one request at a time vs a batch).
CHECKS = {
    "hf": ({}, None, True),
    "compile-tp3": ({"compile": True, "tensor_parallel_size": 3}, {}, True),
    "prefix-ngram-compile": ({"prefix_caching": True, "speculative": "ngram", "compile": True}, {}, True),
    "int8-tp3": ({"quant": "int8", "tensor_parallel_size": 3}, {"quant": "int8"}, False),
    "int4-prefix-ngram-compile": ({"quant": "int4", "prefix_caching": True, "speculative": "ngram",
                                   "compile": True}, {"quant": "int4"}, False),
    "int4-one-at-a-time": ({"quant": "int4", "one_at_a_time": True}, {"quant": "int4"}, False),
}


def child_processes() -> int:
    """Processes whose parent is this one (workers, their resource tracker), read from /proc
    where there is one; multiprocessing's own count elsewhere."""
    proc = Path("/proc")
    if not proc.is_dir():
        return len(multiprocessing.active_children())
    count = 0
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:   # it ended while we looked
            continue
        count += int(fields[1]) == os.getpid()
    return count


def greedy(options: dict, prompts: list[str], tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy ids (all in one batch, or one_at_a_time), and the child processes
    still alive after close()."""
    options = dict(options)
    alone, params = options.pop("one_at_a_time", False), SamplingParams(ignore_eos=True)
    with LLM(**options) as llm:
        ids = ([llm.generate(p, tokens, params).output_ids for p in prompts] if alone else
               [r.output_ids for r in llm.generate_batch(prompts, tokens, params)])
    time.sleep(0.5)   # a stopped worker is reaped, not just signalled
    return ids, child_processes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--only", choices=sorted(CHECKS), action="append", help="run only these checks")
    args = parser.parse_args()
    prompts = reference_prompts()
    failed = []
    for name in args.only or CHECKS:
        stacked, plain, exact = CHECKS[name]
        start = time.perf_counter()
        if plain is None:   # LLM() against HF's generate, the book's reference
            hf = load_engine(DEFAULT_ENGINE, device="cpu")   # 04_engine's BaselineEngine: HF's generate
            want = [r.output_ids for r in hf.generate_batch(prompts, args.tokens, SamplingParams(ignore_eos=True))]
        else:
            want, _ = greedy(plain, prompts, args.tokens)
        got, left = greedy(stacked, prompts, args.tokens)
        same = sum(g == w for g, w in zip(got, want))
        agreed = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
        ok = (same == len(prompts) or not exact) and left == 0
        failed += [] if ok else [name]
        print(f"[check] {name:<26} {same}/{len(prompts)} prompts token-exact, {sum(agreed) / len(agreed):4.1f} of "
              f"{args.tokens} tokens before the first difference (mean), vs "
              f"{'HF generate' if plain is None else plain or 'float32, one process'}; "
              f"{left} child process{'es' if left != 1 else ''} left after close(); "
              f"{time.perf_counter() - start:.0f} s  {('OK' if ok else 'FAILED') if exact else ('agreement' if ok else 'FAILED')}",
              flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
