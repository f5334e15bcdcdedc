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
LlamaModel, with sliced weights, a per-rank config (its own head counts) and a linear() that
adds the collective after the row-split matrices: the forward pass itself is unchanged.
A worker's life (receive the setup, shard, run every step rank 0 broadcasts) is here too; rank 0's
side (the processes, the runner, the engine option) is 18_tensor_parallel_engine.py, and the
scaling model on paper 18_tensor_parallel_scaling.py.

    python 18_tensor_parallel.py --tensor-parallel-size 3       # 3 processes, gloo on CPU
    torchrun --nproc-per-node 3 18_tensor_parallel.py           # the same, started by torchrun
    python 05_server.py --engine 13_continuous_batching_engine:ContinuousBatchingEngine --tensor-parallel-size 3
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import importlib
import os
import pickle
import time

import torch
import torch.distributed as dist

from kit import cli, plugins

engine04 = importlib.import_module("04_engine")
model10 = importlib.import_module("10_model")
runner10 = importlib.import_module("10_model_runner")
paged = importlib.import_module("11_paged_kv")


# Workers wait for the next step inside a broadcast, however long the server sits idle, so the
# group's timeout is long; a dead peer is noticed by the watchers below, not by a timeout.
GROUP_TIMEOUT = datetime.timedelta(days=7)


# --8<-- [start:check]
def check_size(config: model10.ModelConfig | None, size: int) -> None:
    """Each rank owns whole query heads, whole KV heads and an equal slice of the MLP; refused
    in one line otherwise (vLLM has the same rule), before any process starts."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 64:
        raise ValueError(f"tensor_parallel_size must be an integer in [1, 64], got {size!r}")
    if config is None:
        return
    counts = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
              "MLP columns": config.intermediate_size}
    bad = [f"{n} {what}" for what, n in counts.items() if n % size]
    if bad:
        fits = [n for n in range(1, 65) if all(c % n == 0 for c in counts.values())]
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {' and '.join(bad)}: "
                         f"each rank must own whole heads (sizes that fit: {', '.join(map(str, fits))})")
# --8<-- [end:check]


# --8<-- [start:collectives]
class Collectives:
    """The collectives of a tensor-parallel step, each one timed and counted.

    Time spent inside them is what N processes pay for talking (and for waiting on the slowest
    rank); the rest of a step is compute. On CUDA the clock waits for the GPU, so the split is
    honest there too (at the price of the overlap a production engine keeps).
    """

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size = rank, size
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        self.reset()

    def reset(self) -> None:
        self.count, self.bytes, self.seconds = collections.Counter(), collections.Counter(), 0.0

    @contextlib.contextmanager
    def timed(self, kind: str, nbytes: int):
        self.sync()
        start = time.perf_counter()
        yield
        self.sync()
        self.seconds += time.perf_counter() - start
        self.count[kind] += 1
        self.bytes[kind] += nbytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x becomes the sum of all ranks' x (in place)."""
        if self.size > 1:
            with self.timed("all_reduce", x.numel() * x.element_size()):
                dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on every rank -> [rows, size * cols], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self.timed("all_gather", x.numel() * x.element_size() * self.size):
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, message=None):
        """Rank 0's Python object, on every rank (pickled; the other ranks pass None)."""
        if self.size == 1:
            return message
        box = [message]
        with self.timed("broadcast", len(pickle.dumps(message)) if self.rank == 0 else 0):
            dist.broadcast_object_list(box, src=0)
        return box[0]
# --8<-- [end:collectives]


# --8<-- [start:vocab]
class VocabShard:
    """Rows [start, start + rows) of the embedding table, on one rank; with a tied head, the LM head too.

    Lookup: each rank fills the rows of the ids it owns and zeros elsewhere; the all-reduce adds
    exact zeros, so every rank ends with exactly the embedding one process would have read.
    LM head: each rank scores its words; the all-gather lays the ranks' columns side by side.
    """

    def __init__(self, table: torch.Tensor, rank: int, size: int, comm: Collectives):
        self.vocab_size, per_rank = table.shape[0], -(-table.shape[0] // size)   # the last rank may pad
        self.start, self.comm = rank * per_rank, comm
        rows = table[self.start: self.start + per_rank]
        self.weight = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])])
        self.dtype, self.device = self.weight.dtype, self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[local.clamp(0, self.weight.shape[0] - 1)]
        return self.comm.all_reduce(torch.where(mine[:, None], rows, torch.zeros((), dtype=rows.dtype)))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(h @ self.weight.T)[:, :self.vocab_size]   # padding's columns cut
# --8<-- [end:vocab]


# --8<-- [start:model]
ROW_PARALLEL = (".o", ".down")     # partial sums: one all-reduce after each


class TensorParallelModel(model10.LlamaModel):
    """One rank's share of Chapter 6's model: the config's head counts and MLP width are the
    rank's own (attention and the KV pool read them), the matrices are slices, and linear()
    adds the collectives. forward() is LlamaModel's, untouched."""

    def __init__(self, config: model10.ModelConfig, weights: dict, comm: Collectives,
                 full_config: model10.ModelConfig):
        super().__init__(config, weights)
        self.comm, self.full_config = comm, full_config

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[name]
        if isinstance(w, VocabShard):                     # the LM head
            return w.logits(x)
        out = x @ w.T
        return self.comm.all_reduce(out) if name.endswith(ROW_PARALLEL) else out

    @property
    def weight_bytes(self) -> int:
        unique = {id(t): t for t in self.w.values()}      # a tied head counts once
        return sum(t.nbytes if isinstance(t, VocabShard) else t.numel() * t.element_size() for t in unique.values())


def shard(model: model10.LlamaModel, rank: int, size: int, comm: Collectives) -> TensorParallelModel:
    """Rank `rank`'s slices of a loaded model (Megatron's split). Every slice is a copy, so the
    full model's memory goes once the caller lets it go."""
    c, w = model.config, model.w
    check_size(c, size)
    d, heads, kv_heads, mlp = c.head_dim, c.num_heads // size, c.num_kv_heads // size, c.intermediate_size // size

    def rows(m: torch.Tensor, first: int, n: int) -> torch.Tensor:   # rank's block of n rows after `first`
        return m[first + rank * n: first + (rank + 1) * n]

    embed = VocabShard(w["embed"], rank, size, comm)
    out = {"embed": embed, "norm": w["norm"],
           "lm_head": embed if w["lm_head"] is w["embed"] else VocabShard(w["lm_head"], rank, size, comm)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        qkv, gate_up = w[p + "qkv"], w[p + "gate_up"]    # fused at load: [q; k; v] and [gate; up] rows
        out[p + "qkv"] = model10.input_major(torch.cat([
            rows(qkv, 0, heads * d), rows(qkv, c.num_heads * d, kv_heads * d),
            rows(qkv, (c.num_heads + c.num_kv_heads) * d, kv_heads * d)]))
        out[p + "gate_up"] = model10.input_major(torch.cat([rows(gate_up, 0, mlp),
                                                            rows(gate_up, c.intermediate_size, mlp)]))
        out[p + "o"] = model10.input_major(rows(w[p + "o"].T, 0, heads * d).T)       # input columns
        out[p + "down"] = model10.input_major(rows(w[p + "down"].T, 0, mlp).T)
        out[p + "norm1"], out[p + "norm2"] = w[p + "norm1"], w[p + "norm2"]      # small: every rank keeps them
    config = dataclasses.replace(c, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=mlp)
    return TensorParallelModel(config, out, comm, c)
# --8<-- [end:model]


# ---------------------------------------------------------------- a worker's life (rank 1 .. N-1)
def gather_stats(model: TensorParallelModel, kv: paged.KVPool) -> list[dict]:
    """Every rank's own bytes and heads, as each rank counts them, on every rank."""
    mine = {"rank": model.comm.rank, "pid": os.getpid(), "weight_bytes": model.weight_bytes,
            "kv_bytes": kv.nbytes, "heads": model.config.num_heads, "kv_heads": model.config.num_kv_heads}
    if model.comm.size == 1:
        return [mine]
    everyone = [None] * model.comm.size
    dist.all_gather_object(everyone, mine)
    return everyone


# --8<-- [start:worker]
def serve(rank: int, size: int, device: torch.device) -> None:
    """A worker's life: receive the setup, load and shard the model, then run each step rank 0 sends."""
    comm = Collectives(rank, size, device)
    _, folder, dtype, num_blocks, block_size = comm.broadcast()
    model = shard(runner10.load_model(folder, getattr(torch, dtype), device), rank, size, comm)
    kv = paged.KVPool(model.config, num_blocks, block_size, model.dtype, device)
    while True:
        message = comm.broadcast()
        if message[0] == "step":
            _, new_tokens, places, starts, num_logits = message
            model.forward(kv.batch(new_tokens, places, starts, device), kv, num_logits=num_logits)   # rank 0 samples
        elif message[0] == "stats":
            gather_stats(model, kv)
        else:
            return
# --8<-- [end:worker]


def serve_rank(rank: int, size: int, device: str | None) -> None:
    """A worker started by torchrun (which passes rank, size and the rendezvous in the environment)."""
    device = rank_device(engine04.setup.pick_device(device), rank)
    join(rank, size, device, "env://")
    serve(rank, size, device)
    dist.destroy_process_group()


def join(rank: int, size: int, device: torch.device, init_method: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            world_size=size, rank=rank, timeout=GROUP_TIMEOUT)


def rank_device(device: torch.device | str, rank: int) -> torch.device:
    """CPU ranks share the CPU; CUDA rank r computes on GPU r."""
    return torch.device(f"cuda:{rank}") if torch.device(device).type == "cuda" else torch.device("cpu")


def main() -> None:
    engine13 = importlib.import_module("13_continuous_batching_engine")
    parser = engine04.demo_parser("Chapter 14: the assembled engine on N processes (tensor parallelism).")
    cli.add_engine_options(parser, only=("kv_memory", "block_size", "max_num_seqs", "max_num_batched_tokens",
                                         "tensor_parallel_size"))
    parser.add_argument("--threads", type=cli.integer(1, 1024), default=None,
                        help="torch CPU threads in all, shared out among the ranks (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if os.environ.get("WORLD_SIZE", "1") != "1":          # started by torchrun: one process per rank
        args.tensor_parallel_size = int(os.environ["WORLD_SIZE"])
        if int(os.environ["RANK"]) != 0:
            return serve_rank(int(os.environ["RANK"]), args.tensor_parallel_size, args.device)
    options = cli.engine_options(args)
    if torch.device(engine04.setup.pick_device(args.device)).type == "cuda" and torch.cuda.device_count() == 1:
        print("[tensor parallel] one GPU visible: only tensor_parallel_size 1 runs here")
    try:
        engine, prompt, params = engine04.demo(engine13.ContinuousBatchingEngine, args, **options)
        if options.get("tensor_parallel_size", 1) == 1:     # no processes to talk to: time the steps all the same
            plugins.plugin("tensor_parallel")(args.model, 1, args.device)(engine)
        engine.runner.steps.clear()           # the same request again, warm: the steps measured
        engine.generate(prompt, args.max_new_tokens, params)
        engine.runner.report()
    except KeyboardInterrupt:
        raise SystemExit("interrupted: every rank of the group is stopped") from None
    engine.close()
    engine.runner.close()


if __name__ == "__main__":
    main()
