"""Quantised formats that stack: each weight format with each other option, greedy tokens against
the format alone on the reference prompts, as a table.

    python scripts/quant_agreement.py                        # int8, int4, w8a8 x every option
    python scripts/quant_agreement.py --formats int8 --options tp3 --tokens 24

A cell is the mean number of tokens, of --tokens, before the first token that differs from the
format alone (all of them: the same greedy text). Float formats are checked exactly elsewhere
(scripts/check_stacking.py, tests/test_stacking.py); this is the agreement the quantised kernels
keep, on SmolLM2-135M, whose 9 heads and 3 KV heads split over 1, 3 (and, for the MLP, 2) ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kit.workloads import reference_prompts  # noqa: E402
from minivllm import LLM, SamplingParams  # noqa: E402

FORMATS = ("int8", "int4", "w8a8")
# name -> the options stacked on the format. TP 2 splits the MLP and the 3 KV heads unevenly for
# SmolLM2 (9 query heads do not halve), so only TP 3 runs on the default model.
OPTIONS = {
    "tp3": {"tensor_parallel_size": 3},
    "prefix": {"prefix_caching": True},
    "ngram": {"speculative": "ngram"},
    "compile": {"compile": True},
    "tp3-compile": {"tensor_parallel_size": 3, "compile": True},
    "prefix-ngram-compile": {"prefix_caching": True, "speculative": "ngram", "compile": True},
}


def greedy(options: dict, prompts: list[str], tokens: int, model: str | None) -> list[list[int]]:
    with LLM(model, **options) as llm:
        return [r.output_ids for r in llm.generate_batch(prompts, tokens, SamplingParams(ignore_eos=True))]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Mean tokens before the first difference."""
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    return sum(first) / len(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the book's model)")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per prompt (default 24)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--options", nargs="+", choices=sorted(OPTIONS), default=list(OPTIONS))
    args = parser.parse_args()
    prompts = reference_prompts()
    table: dict[str, dict[str, float]] = {}
    for quant in args.formats:
        start = time.perf_counter()
        alone = greedy({"quant": quant}, prompts, args.tokens, args.model)
        for name in args.options:
            got = greedy({"quant": quant, **OPTIONS[name]}, prompts, args.tokens, args.model)
            table.setdefault(name, {})[quant] = agreement(got, alone)
        print(f"[agreement] {quant}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\nmean tokens of {args.tokens} that agree with the format alone, {len(prompts)} reference prompts, greedy")
    print(f"{'option':<22}" + "".join(f"{quant:>8}" for quant in args.formats))
    for name, row in table.items():
        print(f"{name:<22}" + "".join(f"{row[quant]:8.1f}" for quant in args.formats))
    cells = [v for row in table.values() for v in row.values()]
    print(f"{'mean':<22}{sum(cells) / len(cells):8.1f}   (lowest cell {min(cells):.1f})")


if __name__ == "__main__":
    main()
