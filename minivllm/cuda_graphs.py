"""Chapter 15: CUDA graphs for decode. Record the step once, replay it with one launch.

On a GPU, a decode step of the book's model is a few hundred small kernels, each launched from
Python, and the GPU finishes most of them before Python has launched the next: the step is
launch-bound, not memory-bound. A CUDA graph records the kernels of one step, with their
arguments, once; replaying it launches them all with one call. What a graph records is
addresses, not values: every step must put its inputs into the same tensors (static buffers),
and nothing in the step may depend on a value the host would have to read (no `.tolist()`, no
shapes from lengths). So:

    buckets         one graph per batch size 1, 2, 4, 8, 16, 24, ... up to max_num_seqs;
                    a batch of 5 decode rows runs the graph of 8, padded
    static buffers  token ids, positions, slot mapping, block tables (padded to one width),
                    context lengths: filled before each replay, read by every graph
    padding rows    a token at position 0 whose key and value go to a scratch block that the
                    block manager never hands out: they compute garbage, and harm nothing
    attention       decode rows read the pool in place (minivllm/paged_attention.py): the
                    kernel takes its lengths from a tensor, so one graph serves every length

Prefill chunks, mixed steps and speculative verifications stay eager: their shapes vary too
much to record. On the CPU there is no graph to replay: the runner takes the same padded,
static-buffer path and calls the model eagerly, which is how the tests check it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minivllm.kv_cache import KVPool
from minivllm.model import LlamaModel
from minivllm.model_runner import ModelRunner
from minivllm.output import Request
from minivllm.paged_attention import decode_rows, paged_decode


# --8<-- [start:buckets]
def buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 8th, and max_num_seqs itself.
    Few graphs (each holds its own kernels' arguments), yet a batch is never padded by more
    than 7 rows once past 8."""
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs, 8)]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def bucket_for(rows: int, sizes: list[int]) -> int:
    """The smallest bucket that holds `rows` decode rows."""
    return next(b for b in sizes if b >= rows)
# --8<-- [end:buckets]


# --8<-- [start:decode-batch]
@dataclass
class DecodeBatch:
    """The static buffers of a decode step, as the model's forward reads a batch. One set, sized
    for the largest bucket; a bucket's graph reads the first `size` rows of each."""

    token_ids: torch.Tensor      # [rows]: each row's newest token
    positions: torch.Tensor      # [rows]: where that token sits in its sequence
    slots: torch.Tensor          # [rows]: the slot its key and value are written to
    block_tables: torch.Tensor   # [rows, width]: every row padded to the longest context's blocks
    context_lens: torch.Tensor   # [rows]: tokens each row attends to, this one included
    block_size: int
    in_place: bool               # attention by the paged kernel (on a GPU); else Chapter 7's copy

    def rows(self, size: int) -> DecodeBatch:
        """The first `size` rows: views of the same memory, so a graph recorded on them reads
        whatever the buffers hold when it replays."""
        return DecodeBatch(self.token_ids[:size], self.positions[:size], self.slots[:size],
                           self.block_tables[:size], self.context_lens[:size], self.block_size, self.in_place)

    def attend_in_place(self, model: LlamaModel, layer: int, q: torch.Tensor, cache: KVPool) -> torch.Tensor:
        """Chapter 6's forward calls this instead of its own attention (see LlamaModel.attention).
        In place: the paged kernel, lengths read on the device, as a graph needs. Otherwise (the CPU)
        Chapter 7's copy and Chapter 6's attend, the engine's own arithmetic, lengths read on the host."""
        if self.in_place:
            return paged_decode(q, cache.k[layer], cache.v[layer], self.block_tables, self.context_lens,
                                self.block_size)
        rows = decode_rows(self.block_tables, self.context_lens, self.block_size)
        k, v = cache.context(layer, rows)
        return model.attend(q, k, v, rows)
# --8<-- [end:decode-batch]


class CUDAGraphRunner(ModelRunner):
    """Chapter 6's model runner whose decode steps run from recorded graphs (or, on the CPU,
    down the same padded path without them). The pool's last block is the padding rows' scratch."""

    def __init__(self, model: LlamaModel, kv: KVPool, max_num_seqs: int, max_model_len: int):
        super().__init__(model, kv)
        if kv.num_blocks < 2:
            raise ValueError("CUDA graphs need a KV pool of 2 blocks or more (one is the padding rows' scratch)")
        self.scratch_block = kv.num_blocks - 1
        self.buckets = buckets(max_num_seqs)
        self.width = -(-max_model_len // kv.block_size)     # blocks of the longest sequence allowed
        rows, device = self.buckets[-1], model.device
        long, cuda = dict(dtype=torch.long, device=device), device.type == "cuda"
        # Token ids, positions and slots: rows of one tensor, so a step's values go over in one copy,
        # from a pinned host buffer on CUDA (non-blocking: the host goes on to launch the step).
        self.inputs = torch.zeros(3, rows, **long)
        self.inputs[2] = self.scratch_block * kv.block_size
        self.staging = torch.zeros(3, rows, dtype=torch.long, pin_memory=cuda)
        self.cells = torch.zeros(0, 3, dtype=torch.long, pin_memory=cuda)   # block-table edits, grown as needed
        self.copied = torch.cuda.Event() if cuda else None   # the staging may be refilled once it has gone
        self.held: list[tuple[list | None, int]] = [(None, 0)] * rows   # each row's table, entries written
        self.static = DecodeBatch(self.inputs[0], self.inputs[1], self.inputs[2],
                                  torch.full((rows, self.width), self.scratch_block, **long),
                                  torch.ones(rows, dtype=torch.int32, device=device), kv.block_size,
                                  in_place=cuda)
        self.batches = {size: self.static.rows(size) for size in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}     # empty on the CPU, or if capture failed
        # One logits buffer for every bucket (as nano-vllm's outputs): a graph writes its first rows.
        # One per graph would keep each bucket's logits alive, 8 GiB at 512 rows and 128k words.
        self.logits = torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=device)

    # --8<-- [start:fill]
    def fill(self, requests: list[Request], starts: list[int], places: list[list[int]]) -> int:
        """Write one decode step into the static buffers, padded to its bucket; returns the bucket.
        Row i's new token is at position starts[i]; padding rows sit at position 0 of the scratch
        block, with a context of 1 token (their own): they write nothing of anyone's. Host work
        is a few numbers a row: one copy of ids, positions and slots, the lengths computed on the
        device, and of the block tables only the entries that changed since the last step."""
        n, bs, scratch = len(requests), self.kv.block_size, self.scratch_block
        size = bucket_for(n, self.buckets)
        if self.copied is not None:
            self.copied.synchronize()        # the last step's copy has left the staging buffers
        host = self.staging.numpy()
        host[0, :n] = [r.tokens(s, 1)[0] for r, s in zip(requests, starts)]
        host[1, :n] = starts
        host[2, :n] = [t[s // bs] * bs + s % bs for t, s in zip(places, starts)]
        host[:, n:size] = [[0], [0], [scratch * bs]]
        self.inputs.copy_(self.staging, non_blocking=True)   # whole, contiguous: rows past size go unread
        self.static.context_lens[:size].copy_(self.inputs[1, :size] + 1)
        self.write_tables(places, size)
        if self.copied is not None:
            self.copied.record()
        return size

    def write_tables(self, places: list[list[int]], size: int) -> None:
        """Block tables by delta: a row that holds the same table as last step (the block manager
        only appends to a running sequence's) gets its new entries; another table, all of them.
        Entries past a row's context are never read, so a padding row keeps whatever it had: it
        reads one key of some block, and its output is thrown away."""
        cells = []
        for row, table in enumerate(places):
            held, written = self.held[row]
            first = written if held is table and written <= len(table) else 0
            cells += [(row, col, table[col]) for col in range(first, len(table))]
            self.held[row] = (table, len(table))   # the list itself, held: its id cannot be reused
        self.held[len(places):size] = [(None, 0)] * (size - len(places))
        if not cells:
            return
        if len(cells) > self.cells.shape[0]:
            self.cells = torch.zeros(2 * len(cells), 3, dtype=torch.long, pin_memory=self.copied is not None)
        self.cells.numpy()[:len(cells)] = cells
        edits = self.cells[:len(cells)].to(self.static.block_tables.device, non_blocking=True)
        self.static.block_tables[edits[:, 0], edits[:, 1]] = edits[:, 2]
    # --8<-- [end:fill]

    # --8<-- [start:forward]
    def forward(self, requests: list[Request], starts: list[int], lengths: list[int], places: list,
                num_logits: list[int] | None = None) -> torch.Tensor:
        """A step of decode rows only (one new token each, at most max_num_seqs of them, each
        within max_model_len) replays its bucket's graph; any other step runs eagerly."""
        n = len(requests)
        decode = num_logits is None and max(lengths) == 1 and n <= self.buckets[-1] \
            and all(len(t) <= self.width for t in places)
        if not decode or (self.model.device.type == "cuda" and not self.graphs):
            return super().forward(requests, starts, lengths, places, num_logits)
        size = self.fill(requests, starts, places)
        if self.graphs:
            self.graphs[size].replay()                # every kernel of the step, one launch
        else:                                         # the CPU: the same buffers, run eagerly
            self.run_bucket(size)
        # A copy: the next step, of any bucket, writes the same buffer.
        return self.logits[:n].clone()

    def run_bucket(self, size: int) -> torch.Tensor:
        """What a graph records: the bucket's forward, its logits written into the shared buffer."""
        return self.logits[:size].copy_(self.model.forward(self.batches[size], self.kv, all_logits=True))
    # --8<-- [end:forward]

    # --8<-- [start:capture]
    def capture(self) -> float:
        """Record one graph per bucket, largest first, all drawing on one memory pool: a graph's
        temporaries are dead once it ends, so the next graph may reuse them (only one replays at
        a time). Each is run once before it is recorded, so that Triton compiles its kernel and
        cuBLAS picks its algorithms outside the recording. Returns the seconds it took."""
        start, pool = time.perf_counter(), None
        try:
            with torch.cuda.device(self.model.device):   # graphs record on the current device
                for size in reversed(self.buckets):
                    self.run_bucket(size)            # warm-up, not recorded (padding rows only)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.run_bucket(size)        # its temporaries die with it: the next reuses them
                    pool = graph.pool()
                    self.graphs[size] = graph
                torch.cuda.synchronize()
        except Exception as exc:   # a weight format whose kernel cannot be recorded: eager is always right
            print(f"[cuda graphs] capture failed, decoding eagerly ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:120]})", flush=True)
            self.graphs = {}
        return time.perf_counter() - start
    # --8<-- [end:capture]


# --8<-- [start:feature]
class CUDAGraphs:
    """CUDA graphs as a feature the engine is handed (`enforce_eager=False`, or by default on a
    GPU): it builds the model runner. The scheduler and the block manager stay as they are; the
    block manager is only told of one block fewer (the scratch block). Graphs record Chapter 6's
    forward, whatever the weight format, adapters too (Chapter 17); a compiled model (Chapter 13),
    a speculative step (Chapter 10) and a tensor-parallel group (Chapter 14) decode eagerly
    (minivllm/config.py)."""

    name = "cuda_graphs"

    def __init__(self, max_num_seqs: int, max_model_len: int):
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len

    def runner(self, model: LlamaModel, kv: KVPool, build=CUDAGraphRunner) -> CUDAGraphRunner:
        """The runner (`build`: this one, or Chapter 17's, whose rows read their adapter's slot from
        a static buffer too), its graphs captured on a GPU."""
        runner = build(model, kv, self.max_num_seqs, self.max_model_len)
        if model.device.type == "cuda" and torch.cuda.is_available():
            seconds = runner.capture()
            print(f"[engine] CUDA graphs for decode batches of {runner.buckets} captured in {seconds:.1f} s"
                  if runner.graphs else "[engine] no CUDA graphs: decode steps run eagerly", flush=True)
        return runner
# --8<-- [end:feature]
