"""20_many_answers.py - Chapter 16: many answers from one prompt, on shared blocks.

A request for n answers is prefilled once; its n sequences then hold the prompt's KV blocks by
reference count, and the one block they would all write into (the prompt's last, partly filled
block) is copied for each writer but the last: copy-on-write (minivllm/many_answers.py).

    1. fork     the block tables of four samples of one prompt, before and after their first write
    2. beams    a beam search of width 3, step by step: kept beams, finished ones, the best
    3. measure  an RL-rollout-like workload (prompts of ~200 tokens, n answers each, temperature 1):
                KV blocks held at the peak, prompt tokens computed and output tokens/s, for
                n = 1, 4, 8, 16, against the same work sent as n separate requests, with and
                without prefix caching (runs alternated, ratios of one sitting; --small: shorter
                prompts and answers, for a loaded machine)

    python 20_many_answers.py                 # the fork and the beams
    python 20_many_answers.py --measure       # ... then the measurement (--small: a quick one)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from kit import cli
from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.model_files import resolve_model

PROMPT = ("Write a short poem about the sea, the wind and the ships that sail between them, "
          "in four lines, for a child who has never seen the sea.")


# --8<-- [start:fork]
def show_fork(llm: LLM) -> None:
    """Four samples of one prompt: their block tables right after the fork and after their first
    write, with each block's reference count; the one block copied is the prompt's last."""
    seen, copies = [], []
    fork, copy_blocks = llm.scheduler.fork, llm.runner.copy_blocks

    def tables(group) -> list:
        return [[(b, llm.blocks.ref_counts[b]) for b in llm.blocks.tables[m.id]] for m in group]

    def forked(r):                          # the scheduler forks r's siblings onto its blocks
        fork(r)
        seen.append(tables(r.group))

    def copied(pairs):                      # the copies copy-on-write asks of the pool, before the step
        copies.extend(pairs)
        copy_blocks(pairs)

    def trace(work, events):                # the engine, after each step
        group = next((r.group for r in work.requests if r.group), None)
        if group and len(seen) == 1:
            seen.append(tables(group))
    llm.scheduler.fork, llm.runner.copy_blocks, llm.on_step = forked, copied, trace
    try:
        result = llm.generate(PROMPT, SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=24, ignore_eos=True))
    finally:
        llm.scheduler.fork, llm.runner.copy_blocks, llm.on_step = fork, copy_blocks, None
    n_prompt, bs = len(result.prompt_token_ids), llm.blocks.block_size
    print(f"[fork] a prompt of {n_prompt} tokens in blocks of {bs}: {-(-n_prompt // bs)} blocks, the last "
          f"holding {(n_prompt - 1) % bs + 1} tokens; answer 0 computed the first {n_prompt - 1}, alone")
    for title, rows in zip(("forked: every block shared, nothing copied", "after each wrote its last prompt token"),
                           seen):
        print(f"[fork] {title} (block id x reference count):")
        for choice, row in enumerate(rows):
            print(f"         answer {choice}: " + " ".join(f"{b:>3} x{n}" for b, n in row))
    print(f"[fork] blocks copied: {len(copies)} ({', '.join(f'{a} -> {b}' for a, b in copies)}); "
          f"the last writer kept the original")
    for o in result.outputs:
        print(f"[fork] answer {o.index}: {o.text!r}")
# --8<-- [end:fork]


# --8<-- [start:beams]
def show_beams(llm: LLM, tokenizer) -> None:
    """A beam search of width 3, each step's kept beams and the finished ones."""
    def trace(step, running, finished):
        print(f"[beams] step {step + 1}: kept " + " | ".join(
            f"{tokenizer.decode(ids)!r} {float(total):.2f}" for total, ids in running))
        if finished:
            print("          finished: " + " | ".join(f"{tokenizer.decode(ids)!r} {score:.2f}"
                                                    for score, _, ids, _ in finished))
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=1.0)
    [out] = llm.beam_search(["The capital of France is"], params, on_step=trace)
    for s in out.sequences:
        print(f"[beams] {s.score:7.3f}  {s.text!r} ({s.finish_reason})")
# --8<-- [end:beams]


# --8<-- [start:measure]
def rollout(llm: LLM, prompts: list[str], n: int, tokens: int, together: bool) -> dict:
    """One rollout: every prompt n answers at temperature 1, as one request of n (together) or as n
    requests of one. The peak of KV blocks in use, the prompt tokens computed, output tokens/s."""
    peak, computed = [0], [0]

    def trace(work, events):
        peak[0] = max(peak[0], llm.blocks.num_blocks - llm.blocks.num_free)
        computed[0] += sum(max(0, min(s + k, r.n_prompt) - s) for r, s, k in zip(work.requests, work.starts, work.lengths))
    llm.reset_prefix_cache()
    llm.on_step = trace
    base = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True)
    if together:
        batch, params = prompts, dataclasses.replace(base, n=n)
    else:
        batch, params = [p for p in prompts for _ in range(n)], \
            [dataclasses.replace(base, seed=i) for i in range(len(prompts) * n)]
    start = time.perf_counter()
    results = llm.generate(batch, params)
    seconds = time.perf_counter() - start
    llm.on_step = None
    generated = sum(r.metrics.output_tokens for r in results)
    return {"peak": peak[0], "prompt": computed[0], "tok_s": generated / seconds}


def measure(model_dir: str, small: bool, repeats: int) -> None:
    count, tokens, ns, repeat = (4, 16, (1, 4, 8), 2) if small else (16, 64, (1, 4, 8, 16), 6)
    words = ("The committee reviewed the quarterly figures and asked each team to explain the variance "
             "in detail, with examples and a plan for the next quarter. ")
    prompts = [f"Problem {i}: " + words * repeat + "Answer step by step." for i in range(count)]
    engines = {"off": LLM(model_dir, max_num_seqs=64, max_num_batched_tokens=2048),
               "on": LLM(model_dir, max_num_seqs=64, max_num_batched_tokens=2048, prefix_caching=True)}
    n_prompt = len(engines["off"].tokenizer(prompts[0]).input_ids)
    print(f"[measure] {count} prompts of ~{n_prompt} tokens, n answers of {tokens} tokens each, temperature 1.0, "
          f"blocks of {engines['off'].blocks.block_size}; {repeats} alternated runs, medians")
    print(f"[measure] {'n':>3} {'how':<22} {'KV blocks':>9} {'prompt tok':>10} {'tok/s':>7} {'vs n=1 req':>10}")
    for n in ns:
        ways = {"one request of n": ("off", True), "n requests, no cache": ("off", False),
                "n requests, cached": ("on", False)}
        runs = {w: [] for w in ways}
        for _ in range(repeats):
            for way, (which, together) in ways.items():
                runs[way].append(rollout(engines[which], prompts, n, tokens, together))
        for way, got in runs.items():
            speed = statistics.median(g["tok_s"] for g in got)
            ratio = speed / statistics.median(g["tok_s"] for g in runs["n requests, no cache"])
            print(f"[measure] {n:>3} {way:<22} {got[0]['peak']:>9} {got[0]['prompt']:>10} {speed:>7.0f} {ratio:>9.2f}x")
    for llm in engines.values():
        llm.close()
# --8<-- [end:measure]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--measure", action="store_true", help="KV blocks and tokens/s for n = 1, 4, 8, 16")
    parser.add_argument("--small", action="store_true", help="a quick measurement: 4 prompts of ~60 tokens, n up to 8")
    parser.add_argument("--repeats", type=cli.integer(1, 20), default=3)
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    with LLM(model_dir, block_size=8) as llm:
        show_fork(llm)
        show_beams(llm, llm.tokenizer)
    if args.measure:
        measure(model_dir, args.small, args.repeats)
    print(f"[machine] {torch.get_num_threads()} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
