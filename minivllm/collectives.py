"""Chapter 14: the collectives of a tensor-parallel step, over torch.distributed.

Every rank runs the same forward; where the split matrices meet, the ranks talk: an all-reduce
adds partial sums, an all-gather lays slices side by side, and a broadcast hands every worker
the step rank 0 scheduled. One small class does all three, and counts and times them.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import time

import torch
import torch.distributed as dist


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

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Every rank's x becomes the sum (or, with op="max", the largest) of all ranks' x (in place)."""
        if self.size > 1:
            with self.timed("all_reduce", x.numel() * x.element_size()):
                dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
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
