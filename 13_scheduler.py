"""13_scheduler.py - Chapter 9: the scheduler that decides, every step, who runs.

The scheduler itself (requests as tokens plus `num_computed`, chunked prefill, decode,
preemption by recompute) is minivllm/scheduler.py; this script runs it on made-up requests,
no model, and prints every decision.

    python 13_scheduler.py
"""

from __future__ import annotations

from minivllm.block_manager import BlockManager
from minivllm.contracts import SamplingParams
from minivllm.output import Request
from minivllm.scheduler import Scheduler

# The scheduler itself: minivllm/scheduler.py. Here it runs on made-up requests, with no model.


def main() -> None:
    """The scheduler on its own: made-up requests, no model, every decision printed."""
    import argparse

    parser = argparse.ArgumentParser(description="Chapter 9: the scheduler's decisions, step by step, no model. "
                                                 "On the model: python 13_continuous_batching_demo.py")
    parser.add_argument("--num-blocks", type=int, default=8, help="KV pool size in blocks")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8)
    args = parser.parse_args()
    scheduler = Scheduler(BlockManager(args.num_blocks, args.block_size), args.max_num_seqs,
                          args.max_num_batched_tokens)
    params = SamplingParams()
    for i, (prompt_len, budget) in enumerate([(10, 3), (3, 4), (6, 2), (2, 3)]):
        scheduler.add(Request(i, list(range(prompt_len)), params, budget, detok=None))
    print(f"[{args.num_blocks} blocks x {args.block_size} tokens, at most {args.max_num_seqs} sequences and "
          f"{args.max_num_batched_tokens} tokens a step; requests r0..r3 with prompts of 10, 3, 6, 2 tokens]")
    step = 0
    while scheduler.has_work():
        work = scheduler.schedule()
        parts = [f"r{r.id} {'decode' if n == 1 and s >= r.n_prompt else 'prefill'} [{s}:{s + n})"
                 for r, s, n in zip(work.requests, work.starts, work.lengths)]
        line = (f"  step {step:>2}: " + ", ".join(parts) + (f"   preempted {[f'r{r.id}' for r in work.preempted]}"
                                                          if work.preempted else "") +
                f"   free blocks {scheduler.blocks.num_free}")
        finished = []
        for r, s, n in zip(work.requests, work.starts, work.lengths):
            r.num_computed += n
            if r.num_computed == r.num_tokens:      # the model would sample one token here
                r.new_ids.append(0)
                if len(r.new_ids) == r.budget:
                    scheduler.finish(r)
                    finished.append(f"r{r.id}")
        # A request that reached its budget leaves the batch here: said, so that its absence from
        # the next step reads as done, not as dropped. Its blocks count as free from the next line.
        print(line + (f"   finished {', '.join(finished)}" if finished else ""))
        step += 1
    print(f"  done in {step} steps, {scheduler.num_preemptions} preemption(s)")


if __name__ == "__main__":
    main()
