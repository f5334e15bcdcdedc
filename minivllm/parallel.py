"""Chapter 14: tensor parallelism. Every layer's matrices split over N processes.

    QKV and gate/up   split by columns: rank r owns whole attention heads (and their KV heads,
                      or a copy of the one they share when ranks outnumber KV heads) and a
                      slice of the MLP; each rank's output is its own
    O and down        split by rows: each rank's partial sum is added across ranks by one
                      all-reduce, and every rank holds the full hidden state again
    embedding, LM head  split over the vocabulary: each rank looks up the ids it owns (an
                      all-reduce fills in the rest) and scores its words (an all-gather)

This is Megatron-LM's layout, used by vLLM, SGLang and nano-vllm alike. Each rank reads only
its own slices from the checkpoint (`Shard.part`), so no process ever holds the whole model.
The split matrices are weights that talk (`RowParallel`, `VocabShard`): Chapter 6's forward pass
is untouched, and a weight format or compiled steps apply to each rank's slices. The
collectives are in `collectives.py`, the processes themselves in `parallel_workers.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from minivllm.collectives import Collectives
from minivllm.config import check_option
from minivllm.kv_cache import KVPool, blocks_in
from minivllm.model import LlamaModel, ModelConfig
from minivllm.weights import input_major, matmul, nbytes
from minivllm.model_files import pick_device
from minivllm.model_runner import ModelRunner, load_model

# Workers wait for the next step inside a broadcast, however long the server sits idle, so the
# group's timeout is long; a dead peer is noticed by the watchers below, not by a timeout.
GROUP_TIMEOUT = datetime.timedelta(days=7)


# --8<-- [start:check]
def check_size(config: ModelConfig | None, size: int) -> None:
    """Each rank owns whole query heads and an equal slice of the MLP. KV heads are split too when
    the ranks divide them; when the ranks outnumber them, each KV head is copied to the
    size / num_kv_heads ranks whose query heads read it (vLLM does the same). Refused in one
    line otherwise, before any process starts."""
    check_option("tensor_parallel_size", size)   # its row of the options table
    if size is None:
        raise ValueError("tensor_parallel_size must be an integer, got None")
    if config is None:
        return

    def problems(n: int) -> list[str]:
        bad = [f"{k} {what}" for what, k in (("attention heads", config.num_heads),
                                             ("MLP columns", config.intermediate_size)) if k % n]
        if config.num_kv_heads % n and n % config.num_kv_heads:   # neither splits nor copies them evenly
            bad.insert(1, f"{config.num_kv_heads} KV heads")
        return bad

    if bad := problems(size):
        fits = [n for n in range(1, 65) if not problems(n)]
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {' and '.join(bad)}: "
                         f"each rank must own whole query heads, and the KV heads must split evenly over the "
                         f"ranks or be copied evenly to them (sizes that fit: {', '.join(map(str, fits))})")
# --8<-- [end:check]


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
    def of(cls, rows: torch.Tensor, start: int, per_rank: int, vocab_size: int, comm: Collectives) -> VocabShard:
        """A rank's rows of the table (from `start`), padded with zero rows to per_rank: the last
        rank's block may run past the end of the vocabulary."""
        if rows.shape[0] < per_rank:
            rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])])
        return cls(rows, start, vocab_size, comm)

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

    def row_max(self, amax: torch.Tensor) -> torch.Tensor:
        """Each output row's largest |w| over every rank's slice, from this rank's own: a format
        that scales by rows (int8) then picks the scale one process picks, not its slice's."""
        return self.comm.all_reduce(amax.clone(), op="max")


class Shard:
    """Tensor parallelism's step of `load_model` (Chapter 6): this rank's share of the model.

    `part` is asked by the loader, for each tensor of the checkpoint, which rows or columns this
    rank needs, so a rank reads only its own slices from the files; the call then gives the slices
    their collectives and the rank's head counts. It comes first, so that a weight format
    (Chapter 12) quantises the slices and packing (Chapter 13) packs them."""

    name = "tensor_parallel"

    def __init__(self, rank: int, size: int, comm: Collectives):
        self.rank, self.size, self.comm = rank, size, comm

    def part(self, name: str, config: ModelConfig) -> tuple[slice, ...] | None:
        """The index of this rank's part of the checkpoint's tensor `name` (an [out, in] matrix):
        `[rows]` for QKV and gate/up (whole heads, a block of the MLP), `[:, columns]` for O and
        down (their matching inputs), vocabulary rows for the embedding and LM head; None: all of
        it (the norms, small, are on every rank)."""
        c, r, heads, kv_heads, mlp = config, self.rank, *rank_counts(config, self.size)
        kind, d = name.split(".")[-2], c.head_dim
        if kind == "q_proj":
            return (slice(r * heads * d, (r + 1) * heads * d),)
        if kind in ("k_proj", "v_proj"):   # ranks outnumbering KV heads share one: r's query heads read it
            first = r * c.num_kv_heads // self.size
            return (slice(first * d, (first + kv_heads) * d),)
        if kind in ("gate_proj", "up_proj"):
            return (slice(r * mlp, (r + 1) * mlp),)
        if kind == "o_proj":
            return (slice(None), slice(r * heads * d, (r + 1) * heads * d))
        if kind == "down_proj":
            return (slice(None), slice(r * mlp, (r + 1) * mlp))
        if kind in ("embed_tokens", "lm_head"):
            rows = vocab_rows(c.vocab_size, self.size)      # the last rank's block may run past the end
            return (slice(r * rows, min((r + 1) * rows, c.vocab_size)),)
        return None

    def __call__(self, model: LlamaModel) -> LlamaModel:
        """The rank's LlamaModel: Chapter 6's, with the rank's head counts and MLP width in its
        config (attention and the KV pool read them), column slices as plain tensors and the
        row-split and vocabulary-split matrices wrapped with their collectives; the forward pass
        is untouched. A model read whole (no `part`) is cut here, by the same `part`."""
        if model.part != self.part:
            model = cut(model, self.part)
        c, w, comm = model.config, model.w, self.comm
        self.whole = c            # the whole model's config, which `part` reads (Chapter 17's adapters too)
        per_rank = vocab_rows(c.vocab_size, self.size)
        table = lambda rows: VocabShard.of(rows, self.rank * per_rank, per_rank, c.vocab_size, comm)  # noqa: E731
        embed = table(w["embed"])
        out = {**w, "embed": embed, "lm_head": embed if w["lm_head"] is w["embed"] else table(w["lm_head"])}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            out[p + "o"], out[p + "down"] = RowParallel(w[p + "o"], comm), RowParallel(w[p + "down"], comm)
        return LlamaModel(rank_config(c, self.size), out)
# --8<-- [end:model]


def rank_counts(config: ModelConfig, size: int) -> tuple[int, int, int]:
    """A rank's query heads, KV heads and MLP columns (one KV head when the ranks outnumber them)."""
    check_size(config, size)
    return config.num_heads // size, max(1, config.num_kv_heads // size), config.intermediate_size // size


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The whole model's config with one rank's head counts and MLP width, as its shard has them."""
    heads, kv_heads, mlp = rank_counts(config, size)
    return dataclasses.replace(config, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=mlp)


def vocab_rows(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


# The fused matrices of Chapter 6's loader, as the checkpoint's pieces stacked by rows.
STACKED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"),
           "o": ("o_proj",), "down": ("down_proj",)}


def cut(model: LlamaModel, part) -> LlamaModel:
    """A model read whole, cut to `part` as the loader would have read it: each fused matrix is
    taken apart into the checkpoint's pieces, each piece is indexed by `part`, and the slices are
    stacked again. Every slice is a copy, so the full model's memory goes once the caller drops it."""
    c, d = model.config, model.config.head_dim
    rows = {"q_proj": c.num_heads * d, "k_proj": c.num_kv_heads * d, "v_proj": c.num_kv_heads * d,
            "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size, "o_proj": c.hidden_size,
            "down_proj": c.hidden_size}
    w = {name: t[part("model.embed_tokens.weight", c)].clone() if name in ("embed", "lm_head") else t
         for name, t in model.w.items()}
    if model.w["lm_head"] is model.w["embed"]:
        w["lm_head"] = w["embed"]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for fused, pieces in STACKED.items():
            full = torch.split(model.w[p + fused], [rows[piece] for piece in pieces])
            w[p + fused] = input_major(torch.cat([t[part(f"{p}{piece}.weight", c)] for piece, t in zip(pieces, full)]))
    sliced = model.with_weights(w)
    sliced.part = part
    return sliced


def shard(model: LlamaModel, rank: int, size: int, comm: Collectives) -> LlamaModel:
    """Rank `rank`'s share of a model read whole (what each rank reads for itself with `Shard`)."""
    return Shard(rank, size, comm)(model)


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


def rank_steps(shard: Shard, features: list) -> list:
    """A rank's load: its shard, then the features. One with matrices of its own to split (Chapter
    17's adapters: A and B, split as the weights they sit beside) is told the rank's shard first."""
    for feature in features:
        if hasattr(feature, "split_as"):
            feature.split_as(shard)
    return [shard, *features]


def riders(features: list) -> list:
    """The features that ride every step (Chapter 17's adapters): rank 0's copy notes what it set
    up for the step (`lead`), the step carries the notes, and every other rank's copy follows them."""
    return [feature for feature in features if hasattr(feature, "follow")]


# --8<-- [start:pool]
def rank_pool(model: LlamaModel, kv_memory, block_size: int, comm: Collectives) -> KVPool:
    """A rank's KV pool, sized per rank as vLLM sizes each worker's: kv_memory bytes on every rank
    (an int), or what each GPU has left once its shard is in (a function of the device, read on
    each rank: Chapter 15's gpu_memory_utilization). Its blocks hold only the rank's KV heads,
    so N ranks hold N times the tokens of one. Every rank must hold the same blocks (rank 0's
    block tables address them all): the smallest count of any rank."""
    budget = kv_memory(model.device) if callable(kv_memory) else kv_memory
    blocks = torch.tensor([blocks_in(model.config, budget, block_size, model.dtype)])
    if callable(kv_memory) and comm.size > 1:
        on_device = blocks.to(model.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.MIN)
        blocks = on_device.cpu()
    return KVPool(model.config, int(blocks), block_size, model.dtype, model.device)
# --8<-- [end:pool]


# --8<-- [start:worker]
def run_worker(rank: int, size: int, device: torch.device) -> None:
    """A worker's life: receive the setup (the model's folder and the features that follow the
    shard, a weight format or compiled steps), load its shard and size its pool, then run each
    step rank 0 sends."""
    comm = Collectives(rank, size, device)
    _, folder, dtype, kv_memory, block_size, features = comm.broadcast()
    model = load_model(folder, getattr(torch, dtype), device, rank_steps(Shard(rank, size, comm), features))
    kv = rank_pool(model, kv_memory, block_size, comm)
    while True:
        message = comm.broadcast()
        if message[0] == "step":
            _, new_tokens, places, starts, num_logits, notes = message
            for feature, note in zip(riders(features), notes):    # the step's adapters, as rank 0 placed them
                feature.follow(note, [len(t) for t in new_tokens], device)
            model.forward(kv.batch(new_tokens, places, starts, device), kv, num_logits=num_logits)   # rank 0 samples
        elif message[0] == "copy":     # Chapter 16's copy-on-write, on this rank's share of the pool
            kv.copy_blocks(message[1])
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
    run_worker(rank, size, device)
    dist.destroy_process_group()


def join(rank: int, size: int, device: torch.device, init_method: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            world_size=size, rank=rank, timeout=GROUP_TIMEOUT)


def rank_device(device: torch.device | str, rank: int) -> torch.device:
    """CPU ranks share the CPU; CUDA rank r computes on GPU r."""
    return torch.device(f"cuda:{rank}") if torch.device(device).type == "cuda" else torch.device("cpu")

