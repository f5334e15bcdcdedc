"""18_tensor_parallel_engine.py - Chapter 14: the engine on N processes, one rank each.

Rank 0 is the engine itself: tokenizer, scheduler, block manager, sampling, the server. Ranks
1..N-1 are workers that hold their shard of the weights and of the KV pool and do one thing:

    rank 0                                    each worker
    scheduler picks the step's batch
    broadcast (new tokens, starts, block tables)  ->  receives the step
    forward over its shard  <---- all-reduces, all-gather ---->  forward over its shard
    samples from the full logits              waits for the next step

The block tables are rank 0's decisions, so every rank's pool holds the same blocks for the
same requests, each with only its own KV heads. Processes come from torch.multiprocessing
(spawn) when the engine is built with tensor_parallel_size=N, or from torchrun. Talking is
torch.distributed: gloo on CPU, NCCL on CUDA. No process outlives the group: a worker that dies
ends rank 0 with a one-line error, a worker whose parent died exits, Ctrl-C stops them all.

    python 18_tensor_parallel.py --tensor-parallel-size 3
    python 05_server.py --engine 13_continuous_batching_engine:ContinuousBatchingEngine --tensor-parallel-size 3
"""

from __future__ import annotations

import importlib

from minivllm.parallel_workers import (ProcessGroup, TensorParallel, TensorParallelRunner,  # noqa: F401
                                       die_with_parent, worker_main)

# Rank 0's side (the feature, the runner, the processes) lives in minivllm/parallel_workers.py.


def main() -> None:
    """This file's engine is the assembled one with tensor_parallel_size: the demo is 18_tensor_parallel.py."""
    importlib.import_module("18_tensor_parallel").main()

if __name__ == "__main__":
    main()
