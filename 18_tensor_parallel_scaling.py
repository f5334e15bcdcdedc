"""18_tensor_parallel_scaling.py - Chapter 14: when does tensor parallelism pay? A model on paper.

A decode step reads every weight once (and the KV cache of every sequence), so on one device
its time is about bytes / memory bandwidth. With N devices each reads 1/N of the bytes, but
the step now waits for 2 all-reduces per layer (after O and after down), plus one for the
embedding and an all-gather of the logits. Each all-reduce costs a fixed latency plus the
bytes of the hidden state over the link:

    step(N) = max(bytes / (N x HBM), FLOPs / (N x peak))            compute, split N ways
            + (2 x layers + 1) x allreduce(batch x hidden x 2 bytes)  communication, not split
            + allgather(batch x vocab x 4 bytes)
    ring all-reduce over N ranks: 2(N-1) hops of (alpha + bytes / (N x link bandwidth))

The parts are measured where we can (this CPU: one decode step, gloo's all-reduce between two
processes) and taken from datasheets where we cannot (HBM, NVLink, PCIe, Ethernet), each named.

    python 18_tensor_parallel_scaling.py                         # the table, from datasheet figures
    python 18_tensor_parallel_scaling.py --measure               # ... and this CPU's measured parts
    python 18_tensor_parallel_scaling.py --plot book/assets/ch14-scaling.png
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from kit import cli
from minivllm.batch import RaggedBatch
from minivllm.model import LlamaModel, ModelConfig
from minivllm.model_files import resolve_model
from minivllm.parallel import check_size
from minivllm.threads import thread_count


# --8<-- [start:parts]
@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    dtype_bytes: int
    tied: bool          # tie_word_embeddings: the LM head is the embedding table, stored once

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        tables = (1 if self.tied else 2) * self.vocab * self.hidden   # embedding, and the LM head unless tied
        return self.layers * (attn + 3 * self.hidden * self.mlp) + tables

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def splits(self, n: int) -> bool:
        """Whether the engine accepts N ranks for this shape: parallel.check_size decides."""
        config = ModelConfig(self.vocab, self.hidden, self.mlp, self.layers, self.heads, self.kv_heads,
                             self.head_dim, 1e-5, 500000.0, None, 131072, self.tied)
        try:
            check_size(config, n)
        except ValueError:
            return False
        return True


MODELS = (   # shapes from each model's config.json on the Hugging Face hub
    Shape("SmolLM2-135M fp32", 30, 576, 9, 3, 64, 1536, 49152, 4, tied=True),
    Shape("Llama-3.1-8B bf16", 32, 4096, 32, 8, 128, 14336, 128256, 2, tied=False),
    Shape("Llama-3.1-70B bf16", 80, 8192, 64, 8, 128, 28672, 128256, 2, tied=False),
)
# NVIDIA H100 SXM5 80GB datasheet: HBM3 3.35 TB/s, bf16 dense 989 TFLOPS, NVLink 900 GB/s and
# PCIe Gen5 128 GB/s (both directions together: half each way). Ethernet: 100GbE = 12.5 GB/s per
# direction (IEEE 802.3). Per-hop latencies are assumptions of the right order (NCCL small-message
# all-reduces take microseconds in a node, tens of microseconds across nodes): change them with --alpha-us.
GPU = {"hbm": 3.35e12, "flops": 989e12, "memory": 80e9}
LINKS = {"NVLink": (450e9, 2e-6), "PCIe 5": (64e9, 5e-6), "Ethernet 100G": (12.5e9, 15e-6)}
# --8<-- [end:parts]


# --8<-- [start:model]
def allreduce_s(n: int, nbytes: float, bandwidth: float, alpha: float) -> float:
    """A ring all-reduce: reduce-scatter then all-gather, 2(N-1) hops of 1/N of the data each."""
    return 0.0 if n == 1 else 2 * (n - 1) * (alpha + nbytes / n / bandwidth)


def step_s(m: Shape, n: int, bandwidth: float, alpha: float, batch: int = 1, context: int = 1024) -> dict:
    """One decode step of `batch` sequences of `context` tokens on N GPUs, in seconds, by parts."""
    read = m.params * m.dtype_bytes + batch * context * m.kv_bytes_per_token()
    compute = max(read / (n * GPU["hbm"]), 2 * m.params * batch / (n * GPU["flops"]))
    comm = (2 * m.layers + 1) * allreduce_s(n, batch * m.hidden * m.dtype_bytes, bandwidth, alpha)
    comm += 0.0 if n == 1 else (n - 1) * (alpha + batch * m.vocab * 4 / n / bandwidth)   # the logits
    return {"compute": compute, "comm": comm, "total": compute + comm, "fits": read / n <= 0.9 * GPU["memory"],
            "splits": m.splits(n)}
# --8<-- [end:model]


SIZES = (1, 2, 3, 4, 8)


def table(batch: int, context: int, sizes=SIZES) -> dict:
    print(f"[Scaling model] decode step, batch {batch}, context {context} tokens, on H100-class GPUs "
          f"(ms per step;\n  in brackets, speed-up over the smallest N that fits 90% of an 80 GB GPU; '-' where it "
          f"does not;\n  'refused' where the engine cannot split the model's heads or MLP over N ranks: check_size)")
    print(f"  {'model':<20}{'link':<15}" + "".join(f"{'N=' + str(n):>15}" for n in sizes))
    out = {}
    for m in MODELS:
        for link, (bandwidth, alpha) in LINKS.items():
            steps = [step_s(m, n, bandwidth, alpha, batch, context) for n in sizes]
            base = next((s["total"] for s in steps if s["fits"] and s["splits"]), None)
            cells = ["refused" if not s["splits"] else "-" if not s["fits"] else
                     f"{s['total'] * 1e3:.2f}" + (f" ({base / s['total']:.1f}x)" if base else "") for s in steps]
            print(f"  {m.name:<20}{link:<15}" + "".join(f"{c:>15}" for c in cells))
            out[(m.name, link)] = steps
    return out


def pipeline_line(batch: int, context: int) -> None:
    """Across machines: 70B on 2 nodes of 8 GPUs. TP over all 16 puts 161 all-reduces a step on Ethernet;
    TP 8 inside each node and a pipeline of 2 stages sends one hidden state per step across."""
    m, (nv_bw, nv_a), (eth_bw, eth_a) = MODELS[2], LINKS["NVLink"], LINKS["Ethernet 100G"]
    stage = step_s(m, 8, nv_bw, nv_a, batch, context)
    hop = eth_a + batch * m.hidden * m.dtype_bytes / eth_bw
    tp16 = step_s(m, 16, eth_bw, eth_a, batch, context)
    assert tp16["splits"], "TP 16: 64 heads split, 8 KV heads copied to 2 ranks each (check_size)"
    tp16 = tp16["total"]
    # a token passes the two stages in turn: each reads half the model on 8 GPUs and does half the
    # layers' all-reduces over NVLink; between them, one hop over Ethernet
    pp = 2 * step_s(m, 16, nv_bw, nv_a, batch, context)["compute"] + stage["comm"] + hop
    print(f"\n[Across two 8-GPU nodes, Llama-3.1-70B, batch {batch}]  TP 16 over Ethernet: {tp16 * 1e3:.1f} ms/step;"
          f"  TP 8 in each node + 2 pipeline stages: {pp * 1e3:.1f} ms/step (one {batch * m.hidden * 2:,}-byte hop)")
    print(f"  one node, TP 8 over NVLink: {stage['total'] * 1e3:.1f} ms/step; a second node is better spent "
          f"as a replica (data parallelism): twice the requests, no per-step talk")


# --8<-- [start:measure]
def _allreduce_worker(rank: int, port: int, sizes: list[int], reps: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    times = {}
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(x)
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            dist.all_reduce(x)
            samples.append(time.perf_counter() - start)
        times[nbytes] = statistics.median(samples)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def measure_gloo(sizes=(2304, 1 << 16, 1 << 20), reps: int = 50) -> dict[int, float]:
    """Median seconds of one gloo all-reduce between two processes on this machine, per size."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")      # both processes on this machine
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, list(sizes), reps, out), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def measure_decode_ms(folder, steps: int = 24) -> float:
    """Median ms of one batch-1 decode step of the default model, in this process."""
    model = LlamaModel.from_folder(folder)
    cache = model.new_cache(1, 64 + steps)
    model.forward(RaggedBatch.build([list(range(1, 33))], [0], [0], cache.max_len), cache)
    samples = []
    for t in range(steps):
        start = time.perf_counter()
        model.forward(RaggedBatch.build([[7]], [0], [32 + t], cache.max_len), cache)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3
# --8<-- [end:measure]


def cpu_prediction(decode_ms: float, times: dict[int, float], n: int = 3) -> None:
    """The paper model for N ranks of this model on this CPU: this machine's measured parts, each
    rank assumed to have a core of its own. N=3, the size the engine runs (2 does not divide 9 heads)."""
    m = MODELS[0]
    assert m.splits(n), f"the engine refuses {m.name} on {n} ranks"
    bandwidth = ((1 << 20) - (1 << 16)) / max(times[1 << 20] - times[1 << 16], 1e-9)   # latency cancels
    hidden = m.hidden * m.dtype_bytes
    alpha = max(times[hidden] / 2 - hidden / 2 / bandwidth, 0.0)   # a 2-rank ring is 2 hops: one hop's latency
    print(f"\n[This CPU, measured: {thread_count()}]  batch-1 decode step {decode_ms:.1f} ms; "
          f"gloo all-reduce between 2 processes: {times[hidden] * 1e6:.0f} us for {hidden:,} bytes (one token's hidden state), "
          f"{times[1 << 16] * 1e6:.0f} us for 64 KiB, {times[1 << 20] * 1e3:.2f} ms for 1 MiB (~{bandwidth / 1e9:.1f} GB/s)")
    one = allreduce_s(n, hidden, bandwidth, alpha)                 # the ring of N ranks, 2(N-1) hops
    logits = (n - 1) * (alpha + m.vocab * 4 / n / bandwidth)        # the all-gather, as in step_s
    comm = (2 * m.layers + 1) * one + logits
    print(f"  N={n} ranks, on paper: compute stays {decode_ms:.1f} ms (the same 2 cores, no core added), "
          f"communication {2 * m.layers + 1} all-reduces x {one * 1e6:.0f} us ({2 * (n - 1)} hops of {alpha * 1e6:.0f} us) "
          f"+ logits {logits * 1e3:.1f} ms = {comm * 1e3:.1f} ms -> predicted {decode_ms + comm * 1e3:.1f} ms per step "
          f"({(decode_ms + comm * 1e3) / decode_ms:.2f}x N=1)")


def plot(path: str, results: dict, sizes=SIZES) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    styles = {"NVLink": "-", "PCIe 5": "--", "Ethernet 100G": ":"}
    colours = {m.name: c for m, c in zip(MODELS, ("tab:green", "tab:blue", "tab:red"))}
    for (name, link), steps in results.items():
        points = [(n, s["total"] * 1e3) for n, s in zip(sizes, steps) if s["fits"] and s["splits"]]
        if points:
            ax.plot(*zip(*points), styles[link], marker="o", color=colours[name], label=f"{name}, {link}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("tensor-parallel size N (GPUs)")
    ax.set_ylabel("decode step, batch 1 (ms, log scale)")
    ax.set_title("Tensor parallelism on paper (H100 datasheet figures; 18_tensor_parallel_scaling.py)", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\n[plot] {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 14: tensor parallelism's step time vs N, on paper.")
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--batch", type=cli.integer(1, 4096), default=1, help="sequences per decode step")
    parser.add_argument("--context", type=cli.integer(1, 1 << 20), default=1024, help="tokens of KV per sequence")
    parser.add_argument("--alpha-us", type=cli.number(above=0), nargs=3, default=None, metavar=("NVLINK", "PCIE", "ETH"),
                        help="per-hop latency of each link, microseconds (default 2 5 15)")
    parser.add_argument("--measure", action="store_true", help="also measure this CPU's parts (about 20 s)")
    parser.add_argument("--plot", type=cli.plot_file(), default=None, help="write step time vs N as a figure")
    args = parser.parse_args()
    if args.alpha_us:
        for link, alpha in zip(LINKS, args.alpha_us):
            LINKS[link] = (LINKS[link][0], alpha * 1e-6)
    results = table(args.batch, args.context)
    pipeline_line(args.batch, args.context)
    if args.measure:
        times = measure_gloo()
        cpu_prediction(measure_decode_ms(resolve_model(args.model)), times)
    if args.plot:
        plot(args.plot, results)


if __name__ == "__main__":
    main()
