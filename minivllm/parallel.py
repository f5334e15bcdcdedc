"""Chapter 14: tensor parallelism. Every layer's matrices split over N processes.

    QKV and gate/up   split by columns: rank r owns whole attention heads (and their KV heads)
                      and a slice of the MLP; each rank's output is its own
    O and down        split by rows: each rank's partial sum is added across ranks by one
                      all-reduce, and every rank holds the full hidden state again
    embedding, LM head  split over the vocabulary: each rank looks up the ids it owns (an
                      all-reduce fills in the rest) and scores its words (an all-gather)

This is Megatron-LM's layout, used by vLLM, SGLang and nano-vllm alike. The split matrices
are weights that talk (`RowParallel`, `VocabShard`): Chapter 6's forward pass is untouched,
and a weight format or compiled steps apply to each rank's slices. The processes themselves
are in `parallel_workers.py`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import pickle
import time

import torch
import torch.distributed as dist

from minivllm.kv_cache import KVPool
from minivllm.model import LlamaModel, ModelConfig
from minivllm.weights import input_major, matmul, nbytes
from minivllm.model_files import pick_device
from minivllm.model_runner import ModelRunner, load_model

# Workers wait for the next step inside a broadcast, however long the server sits idle, so the
# group's timeout is long; a dead peer is noticed by the watchers below, not by a timeout.
GROUP_TIMEOUT = datetime.timedelta(days=7)


# --8<-- [start:check]
def check_size(config: ModelConfig | None, size: int) -> None:
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
    The rows themselves are `wrapped`, any weight (Chapter 12 may quantise them, Chapter 13 pack them).
    """

    def __init__(self, wrapped, start: int, vocab_size: int, comm: Collectives, dtype=None, device=None):
        self.wrapped, self.start, self.vocab_size, self.comm = wrapped, start, vocab_size, comm
        self.rows = wrapped.shape[0]
        self.dtype = dtype or wrapped.dtype              # what a lookup hands back: the table's own
        self.device = device or wrapped.device

    @classmethod
    def of(cls, table: torch.Tensor, rank: int, size: int, comm: Collectives) -> VocabShard:
        vocab_size, per_rank = table.shape[0], -(-table.shape[0] // size)   # the last rank may pad
        rows = table[rank * per_rank: (rank + 1) * per_rank]
        return cls(torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])]),
                   rank * per_rank, vocab_size, comm)

    def replace(self, wrapped) -> VocabShard:
        return VocabShard(wrapped, self.start, self.vocab_size, self.comm, self.dtype, self.device)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.wrapped.shape[1])

    @property
    def nbytes(self) -> int:
        return nbytes(self.wrapped)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        rows = self.wrapped[local.clamp(0, self.rows - 1)].to(self.dtype)
        return self.comm.all_reduce(torch.where(mine[:, None], rows, torch.zeros((), dtype=rows.dtype)))

    def matmul(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(matmul(self.wrapped, h))[:, :self.vocab_size]   # padding's columns cut
# --8<-- [end:vocab]


# --8<-- [start:model]
class RowParallel:
    """A matrix split by its inputs: each rank's product is a partial sum, and one all-reduce
    adds them, so every rank holds the full output again. `wrapped` is the rank's slice, any weight."""

    def __init__(self, wrapped, comm: Collectives):
        self.wrapped, self.comm = wrapped, comm

    def replace(self, wrapped) -> RowParallel:
        return RowParallel(wrapped, self.comm)

    @property
    def nbytes(self) -> int:
        return nbytes(self.wrapped)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(matmul(self.wrapped, x))


def shard(model: LlamaModel, rank: int, size: int, comm: Collectives) -> LlamaModel:
    """Rank `rank`'s slices of a loaded model (Megatron's split): Chapter 6's LlamaModel with the
    rank's own head counts and MLP width in its config (attention and the KV pool read them),
    column slices as plain tensors and the row-split and vocabulary-split matrices wrapped with
    their collectives; the forward pass is untouched. Every slice is a copy, so the full
    model's memory goes once the caller lets it go."""
    c, w = model.config, model.w
    check_size(c, size)
    d, heads, kv_heads, mlp = c.head_dim, c.num_heads // size, c.num_kv_heads // size, c.intermediate_size // size

    def rows(m: torch.Tensor, first: int, n: int) -> torch.Tensor:   # rank's block of n rows after `first`
        return m[first + rank * n: first + (rank + 1) * n]

    embed = VocabShard.of(w["embed"], rank, size, comm)
    out = {"embed": embed, "norm": w["norm"],
           "lm_head": embed if w["lm_head"] is w["embed"] else VocabShard.of(w["lm_head"], rank, size, comm)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        qkv, gate_up = w[p + "qkv"], w[p + "gate_up"]    # fused at load: [q; k; v] and [gate; up] rows
        out[p + "qkv"] = input_major(torch.cat([
            rows(qkv, 0, heads * d), rows(qkv, c.num_heads * d, kv_heads * d),
            rows(qkv, (c.num_heads + c.num_kv_heads) * d, kv_heads * d)]))
        out[p + "gate_up"] = input_major(torch.cat([rows(gate_up, 0, mlp),
                                                            rows(gate_up, c.intermediate_size, mlp)]))
        out[p + "o"] = RowParallel(input_major(rows(w[p + "o"].T, 0, heads * d).T), comm)       # input columns
        out[p + "down"] = RowParallel(input_major(rows(w[p + "down"].T, 0, mlp).T), comm)
        out[p + "norm1"], out[p + "norm2"] = w[p + "norm1"], w[p + "norm2"]      # small: every rank keeps them
    config = dataclasses.replace(c, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=mlp)
    return LlamaModel(config, out)


class Shard:
    """Tensor parallelism's step of `load_model` (Chapter 6): model -> this rank's share. It comes
    first, so that a weight format (Chapter 12) quantises the slices and packing (Chapter 13)
    packs them: every rank holds its own slice in the engine's format."""

    name = "tensor_parallel"

    def __init__(self, rank: int, size: int, comm: Collectives):
        self.rank, self.size, self.comm = rank, size, comm

    def __call__(self, model: LlamaModel) -> LlamaModel:
        return shard(model, self.rank, self.size, self.comm)
# --8<-- [end:model]


# ---------------------------------------------------------------- a worker's life (rank 1 .. N-1)
def gather_stats(model: LlamaModel, kv: KVPool, comm: Collectives) -> list[dict]:
    """Every rank's own bytes and heads, as each rank counts them, on every rank."""
    mine = {"rank": comm.rank, "pid": os.getpid(), "weight_bytes": model.weight_bytes,
            "kv_bytes": kv.nbytes, "heads": model.config.num_heads, "kv_heads": model.config.num_kv_heads}
    if comm.size == 1:
        return [mine]
    everyone = [None] * comm.size
    dist.all_gather_object(everyone, mine)
    return everyone


# --8<-- [start:worker]
def serve(rank: int, size: int, device: torch.device) -> None:
    """A worker's life: receive the setup (the model's folder and the features that follow the
    shard, a weight format or compiled steps), load its shard, then run each step rank 0 sends."""
    comm = Collectives(rank, size, device)
    _, folder, dtype, num_blocks, block_size, features = comm.broadcast()
    model = load_model(folder, getattr(torch, dtype), device, [Shard(rank, size, comm), *features])
    kv = KVPool(model.config, num_blocks, block_size, model.dtype, device)
    while True:
        message = comm.broadcast()
        if message[0] == "step":
            _, new_tokens, places, starts, num_logits = message
            model.forward(kv.batch(new_tokens, places, starts, device), kv, num_logits=num_logits)   # rank 0 samples
        elif message[0] == "stats":
            gather_stats(model, kv, comm)
        elif message[0] == "warm_up":   # the same warm-up steps as rank 0, collectives and all
            ModelRunner(model, kv).warm_up()
        else:
            return
# --8<-- [end:worker]


def serve_rank(rank: int, size: int, device: str | None) -> None:
    """A worker started by torchrun (which passes rank, size and the rendezvous in the environment)."""
    device = rank_device(pick_device(device), rank)
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

