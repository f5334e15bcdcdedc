"""18_tensor_parallel.py - Chapter 14: beyond one machine. Tensor parallelism on torch.distributed.

A 135M model fits anywhere; an 8B model in bf16 (16 GB) barely fits one GPU, a 70B one
(141 GB) fits none. Tensor parallelism splits every layer's matrices over N devices, so each
holds and reads 1/N of the weights and 1/N of the KV cache, and they talk twice per layer:

    QKV and gate/up   split by columns: rank r owns whole attention heads (and their KV heads)
                      and a slice of the MLP; no talking needed, each rank's output is its own
    O and down        split by rows: each rank's partial sum is summed across ranks by one
                      all-reduce, and every rank holds the full hidden state again
    embedding, LM head  split over the vocabulary: each rank looks up the ids it owns (an
                      all-reduce fills in the rest); each computes the logits of its words
                      and an all-gather puts the row back together

This is Megatron-LM's layout, used by vLLM, SGLang and nano-vllm alike. The model is Chapter 6's
LlamaModel, with sliced weights, a per-rank config (its own head counts) and weights whose
matmul adds the collective after the row-split matrices: the forward pass itself is unchanged.
The shard and a worker's life (receive the setup, shard, run every step rank 0 broadcasts) are
minivllm/parallel.py; rank 0's side (the processes, the runner, the engine option)
minivllm/parallel_workers.py; the scaling model on paper 18_tensor_parallel_scaling.py.

    python 18_tensor_parallel.py --tensor-parallel-size 3       # 3 processes, gloo on CPU
    torchrun --nproc-per-node 3 18_tensor_parallel.py           # the same, started by torchrun
    python 05_server.py --engine minivllm:LLM --tensor-parallel-size 3
"""

from __future__ import annotations

import os

import torch

from kit import cli
from kit.demo import demo, demo_parser
from minivllm.llm import LLM
from minivllm.model_files import pick_device
from minivllm.parallel import serve_rank


# The split (the sharded weights, read rank by rank, and a worker's life) lives in minivllm/parallel.py,
# the collectives in minivllm/collectives.py.


def main() -> None:
    parser = demo_parser("Chapter 14: the assembled engine on N processes (tensor parallelism).")
    cli.add_engine_options(parser, only=("kv_memory", "block_size", "max_num_seqs", "max_num_batched_tokens",
                                         "tensor_parallel_size"))
    args = parser.parse_args()   # --threads (demo_parser's): torch's threads in all, shared out among the ranks
    if os.environ.get("WORLD_SIZE", "1") != "1":          # started by torchrun: one process per rank
        args.tensor_parallel_size = int(os.environ["WORLD_SIZE"])
        if int(os.environ["RANK"]) != 0:
            return serve_rank(int(os.environ["RANK"]), args.tensor_parallel_size, args.device)
    options = {name: value for name, value in cli.engine_options(args).items() if name != "dtype"}  # demo's own
    if torch.device(pick_device(args.device)).type == "cuda" and torch.cuda.device_count() == 1:
        print("[tensor parallel] one GPU visible: only tensor_parallel_size 1 runs here")
    try:
        # one process is a group of one: no one to talk to, the steps timed all the same
        options["tensor_parallel_size"] = options.get("tensor_parallel_size", 1)
        engine, prompt, params = demo(LLM, args, **options)
        engine.runner.steps.clear()           # the same request again, warm: the steps measured
        engine.generate(prompt, args.max_new_tokens, params)
        engine.runner.report()
    except KeyboardInterrupt:
        raise SystemExit("interrupted: every rank of the group is stopped") from None
    engine.close()     # the workers too


if __name__ == "__main__":
    main()
