"""vllm_offline.py - vLLM's CPU build on the benchmark's requests, run with the peer venv's python.

    $VENV/bin/python scripts/peers/vllm_offline.py MODEL_FOLDER workload.json
    $VENV/bin/python scripts/peers/vllm_offline.py MODEL_FOLDER --single "a prompt" --prefill "a long prompt"

The workload is a JSON list of {"prompt": text, "max_tokens": n}. Every request runs greedy,
with ignore_eos, to its own budget; the whole list runs three times in this one process and the
median output tokens/s is printed on a `workload:` line (kit/peers.py reads it). The settings
match our engine's defaults where vLLM has the same knob: float32, eager (no graphs on a CPU),
32 sequences a step, prefix caching off unless asked for (vLLM turns it on by default, and a
repeated prompt would then time a cache hit, not a prefill).
"""

import argparse
import json
import statistics
import time

RUNS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model folder (the project's default model lives in its cache)")
    parser.add_argument("workload", nargs="?", help='JSON list of {"prompt": str, "max_tokens": int}')
    parser.add_argument("--single", help="also time this prompt alone, 128 new tokens (batch 1)")
    parser.add_argument("--prefill", help="also time this prompt with 1 new token (prefill tokens/s)")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams   # the peer venv's, not ours

    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.prefix_caching)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)

    def runs(prompts, params):
        """RUNS passes over the same requests: (outputs of the last pass, seconds of each)."""
        seconds = []
        for _ in range(RUNS):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        return outputs, seconds

    if args.workload:
        with open(args.workload) as f:
            work = json.load(f)
        params = [SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
        outputs, seconds = runs([w["prompt"] for w in work], params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates = [tokens / s for s in seconds]
        # Three decimals: a prefill run makes one token a request, and one decimal of its rate
        # would round the seconds kit/peers.py derives from it by a few percent.
        print(f"workload: {len(work)} requests, output tokens/s median {statistics.median(rates):.3f} "
              f"(runs [{', '.join(f'{r:.3f}' for r in rates)}])")
    if args.single:
        _, seconds = runs([args.single], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
        print(f"batch 1: tokens/s median {statistics.median(128 / s for s in seconds):.1f}")
    if args.prefill:
        outputs, seconds = runs([args.prefill], SamplingParams(temperature=0.0, max_tokens=1))
        n = len(outputs[0].prompt_token_ids)
        print(f"prefill: {n} tokens, tokens/s median {statistics.median(n / s for s in seconds):.1f}")


if __name__ == "__main__":
    main()
