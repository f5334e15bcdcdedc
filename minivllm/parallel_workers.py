"""Chapter 14: the engine on N processes, one rank each.

Rank 0 is the engine itself: tokenizer, scheduler, block manager, sampling, the server. Ranks
1..N-1 are workers that hold their shard of the weights and of the KV pool and do one thing:
receive each step rank 0 broadcasts and run the same forward. Processes come from
torch.multiprocessing (spawn), or from torchrun; talking is torch.distributed (gloo on CPU,
NCCL on CUDA). No process outlives the group: a worker that dies ends rank 0 with a one-line
error, a worker whose parent died exits, and the runner's `close()` stops them all.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import json
import multiprocessing.connection
from multiprocessing import resource_tracker
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.kv_cache import KVPool
from minivllm.model import LlamaModel, ModelConfig
from minivllm.model_runner import ModelRunner, load_model
from minivllm.collectives import Collectives
from minivllm.engine_loop import EngineUnavailable
from minivllm.parallel import (Shard, check_size, gather_stats, join, rank_device, rank_pool, rank_steps, riders,
                              run_worker)

# --8<-- [start:feature]
class TensorParallel:
    """The engine's tensor_parallel_size option as a feature it is handed: checked now, before any
    weights load or any process starts; `start` then builds rank 0's runner over a group of
    `size` processes. Every rank loads the model with the same features after its shard (a
    weight format, compiled steps), so they stack."""

    name = "tensor_parallel"

    def __init__(self, size: int, folder: Path, device: torch.device):
        config = Path(folder) / "config.json"          # a hub id not fetched yet is checked once loaded
        check_size(ModelConfig.from_json(json.loads(config.read_text())) if config.is_file() else None, size)
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism runs on cpu (gloo) or cuda (nccl), not {kind}")
        if kind == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        self.size = size

    def start(self, folder: Path, dtype: torch.dtype, device: torch.device, kv_memory, block_size: int,
              features: Sequence = ()) -> TensorParallelRunner:
        """Start the workers, load rank 0's shard (only its slices are read from the files) and its
        KV pool of kv_memory bytes per rank (or a function of the device that says how many: see
        `rank_pool`), each block holding only this rank's KV heads; the block manager and
        scheduler are those of one process. Nothing whole is built here, weights or pool."""
        group = ProcessGroup(self.size, device) if self.size > 1 else None
        try:
            comm = Collectives(0, self.size, device)
            comm.broadcast(("setup", str(folder), str(dtype).removeprefix("torch."), kv_memory, block_size,
                            list(features)))
            model = load_model(folder, dtype, device, rank_steps(Shard(0, self.size, comm), list(features)))
            pool = rank_pool(model, kv_memory, block_size, comm)
        except BaseException:
            if group:
                group.close()
            raise
        return TensorParallelRunner(model, pool, comm, group, riders(list(features)))
# --8<-- [end:feature]


# --8<-- [start:runner]
class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: each step's batch goes to every worker before the forward."""

    def __init__(self, model: LlamaModel, kv: KVPool, comm: Collectives, group: ProcessGroup | None,
                 riders: Sequence = ()):
        super().__init__(model, kv)
        self.comm, self.group, self.lock, self.closed = comm, group, threading.Lock(), False
        self.riders = list(riders)     # features that set up each step on every rank (Chapter 17's adapters)
        self.steps: collections.deque = collections.deque(maxlen=4096)   # timings of recent steps
        atexit.register(self.close)

    def forward(self, requests, starts, lengths, places, num_logits=None):
        """Every rank runs the same forward: the batch goes to the workers first."""
        with self.lock:
            if self.closed:
                raise EngineUnavailable("the tensor-parallel group is closed")
            comm = self.comm
            comm.reset()
            start = time.perf_counter()
            try:
                new_tokens = [r.tokens(s, n) for r, s, n in zip(requests, starts, lengths)]
                notes = [rider.lead(requests, lengths, self.model.device) for rider in self.riders]
                comm.broadcast(("step", new_tokens, places, starts, num_logits, notes))
                logits = self.model.forward(self.kv.batch(new_tokens, places, starts, self.model.device), self.kv,
                                            num_logits=num_logits)
            except BaseException as exc:   # ranks may now wait at different collectives: the group cannot go on
                self.closed = True
                if self.group:
                    self.group.close(grace=0.0)
                if isinstance(exc, Exception):   # nothing more can be served: the server says 503
                    raise EngineUnavailable(f"a tensor-parallel step failed: {exc}") from exc
                raise
            comm.sync()
            self.steps.append({"prefill": max(lengths) > 1, "seqs": len(lengths),
                               "seconds": time.perf_counter() - start, "comm_seconds": comm.seconds,
                               **comm.count, **{f"{k}_bytes": v for k, v in comm.bytes.items()}})
            return logits

    def admit(self, request) -> None:
        for rider in self.riders:
            rider.admit(request)

    def release(self, request) -> None:
        for rider in self.riders:
            rider.release(request)

    def features(self) -> dict:
        return {name: value for rider in self.riders for name, value in rider.features().items()}

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Every rank copies its share of the blocks (Chapter 16's copy-on-write)."""
        if not copies:   # most steps: no message to the other ranks at all
            return
        with self.lock:
            self.comm.broadcast(("copy", copies))
            self.kv.copy_blocks(copies)

    def warm_up(self) -> float:
        """Every rank warms up together: a compiled model's warm-up steps run collectives."""
        with self.lock:
            self.comm.broadcast(("warm_up",))
            return super().warm_up()

    def rank_stats(self) -> list[dict]:
        """Every rank's own bytes and heads, as the rank itself counts them."""
        with self.lock:
            self.comm.broadcast(("stats",))
            return gather_stats(self.model, self.kv, self.comm)

    def report(self) -> None:
        """Each rank's bytes, then the collectives and the time of a decode step, split."""
        stats, decode = self.rank_stats(), [s for s in self.steps if not s["prefill"]]
        print(f"\n[Tensor parallel]  {len(stats)} process{'es' if len(stats) > 1 else ''}, "
              f"backend {dist.get_backend() if dist.is_initialized() else 'none (one process)'}")
        for s in stats:
            print(f"  rank {s['rank']} (pid {s['pid']}): weights {s['weight_bytes'] / 1e6:7.1f} MB, "
                  f"KV pool {s['kv_bytes'] / 2**20:6.1f} MiB, {s['heads']} heads / {s['kv_heads']} KV heads")
        if not decode:
            return
        mean = lambda key: sum(s.get(key, 0) for s in decode) / len(decode)   # noqa: E731
        reduces = mean("all_reduce")
        print(f"  per decode step ({len(decode)} steps, batch {mean('seqs'):.0f}): {reduces:.0f} all-reduces of "
              f"{mean('all_reduce_bytes') / max(reduces, 1):,.0f} bytes, {mean('all_gather'):.0f} all-gather of "
              f"{mean('all_gather_bytes'):,.0f} bytes, {mean('broadcast'):.0f} broadcast of the step")
        total, comm = mean("seconds") * 1e3, mean("comm_seconds") * 1e3
        print(f"  time per decode step: {total:.2f} ms = compute {total - comm:.2f} ms + communication {comm:.2f} ms")

    def close(self) -> None:
        """Stop the workers (a 'stop' step when the group is idle, signals otherwise); idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.group is None:
            return
        self.group.closing = True
        if self.lock.acquire(timeout=5):           # not in the middle of a step: ask politely
            try:
                self.comm.broadcast(("stop",))
            except Exception:   # noqa: BLE001 - a broken group is ended by signals below
                pass
            finally:
                self.lock.release()
        self.group.close()
# --8<-- [end:runner]


def die_with_parent(parent_pid: int) -> None:
    """A worker never outlives its parent: the kernel kills it when its parent dies (Linux), and a
    watchdog thread checks the parent's pid twice a second everywhere."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:     # it died before the watch began
        os._exit(1)


def worker_main(rank: int, size: int, init_method: str, device_type: str, parent_pid: int, threads: int) -> None:
    """The entry point of a spawned worker process."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches every process: rank 0 ends the group
    torch.set_num_threads(threads)
    device = rank_device(device_type, rank)
    try:
        join(rank, size, device, init_method)
        run_worker(rank, size, device)
    except Exception as exc:   # noqa: BLE001 - rank 0 gone or the group broken: say so in one line
        print(f"[rank {rank}] stopped: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


FAILURE_GRACE_S = 2.0   # after a worker dies: time for a server to send its clients the error


# --8<-- [start:group]
class ProcessGroup:
    """Rank 0's side of the group: the spawned workers, the watcher that ends everything when one
    dies, and torch.distributed's default group. Under torchrun there is nothing to spawn."""

    def __init__(self, size: int, device: torch.device):
        if dist.is_initialized():
            raise ValueError("this process already belongs to a tensor-parallel group: close that engine's runner first")
        self.size, self.closing, self.procs = size, False, []
        self.on_failure = None   # told why, before the process ends: the engine fails its requests
        if os.environ.get("WORLD_SIZE", "1") != "1":     # torchrun started every rank already
            if int(os.environ["WORLD_SIZE"]) != size or int(os.environ["RANK"]) != 0:
                raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes; the engine asks for {size}")
            join(0, size, rank_device(device, 0), "env://")
            return
        with socket.socket() as s:                       # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # every rank on this machine
        threads = max(1, torch.get_num_threads() // size)       # the cores, shared out
        torch.set_num_threads(threads)
        context = mp.get_context("spawn")
        # Spawning starts multiprocessing's resource tracker, a process of its own, unless one runs
        # already; close() stops it again when we started it, so nothing outlives the engine.
        self.started_tracker = getattr(resource_tracker._resource_tracker, "_fd", None) is None
        init_method = f"tcp://127.0.0.1:{port}"
        for rank in range(1, size):
            proc = context.Process(target=worker_main, name=f"tp-rank-{rank}", daemon=True,
                                   args=(rank, size, init_method, device.type, os.getpid(), threads))
            proc.start()
            self.procs.append(proc)
        threading.Thread(target=self.watch, name="tp-watcher", daemon=True).start()
        join(0, size, rank_device(device, 0), init_method)
        print(f"[engine] tensor parallel: {size} ranks ({dist.get_backend()}), worker pids "
              f"{[p.pid for p in self.procs]}", flush=True)

    def watch(self) -> None:
        """Wait for any worker to exit; unless we are closing, that ends the whole group."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        proc = next(p for p in self.procs if p.sentinel in ended)
        proc.join(1)
        reason = (f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}; "
                  f"the group of {self.size} processes ends")
        self.closing = True
        if self.on_failure:   # every stream in flight gets an error event, new requests a 503
            self.on_failure(reason)
            time.sleep(FAILURE_GRACE_S)
        print(f"error: {reason}", file=sys.stderr, flush=True)
        self.stop_workers()
        os._exit(1)        # rank 0 cannot compute alone: the engine (and a server around it) ends now

    def stop_workers(self, grace: float = 5.0) -> None:
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def close(self, grace: float = 5.0) -> None:
        self.closing = True
        self.stop_workers(grace)
        if dist.is_initialized():
            dist.destroy_process_group()
        stop_tracker = getattr(resource_tracker._resource_tracker, "_stop", None)   # CPython's, 3.8+
        if getattr(self, "started_tracker", False) and stop_tracker is not None:
            stop_tracker()
# --8<-- [end:group]
