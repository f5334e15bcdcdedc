"""16_quantization.py - Chapter 12: fewer bytes per weight, because decode reads every one.

At batch 1 a decode step multiplies one vector by every weight matrix once. The
arithmetic is tiny; reading 538 MB of float32 weights is not. So the speed of decode
is set by bytes read per token, and the way to go faster is to store weights in fewer:

    float32   4 bytes     bf16/fp16   2 bytes (the first, simplest step: a cast)
    int8      1 byte  + one scale per output channel (row)
    int4      0.5 byte + a scale and a zero point per group of 32/64/128 inputs

Only weights are quantised; activations, the KV cache and the norms stay as they were.
Every format keeps two ways to multiply: a *reference* path that dequantises back to
floats and runs an ordinary matmul (the arithmetic, in plain sight), and a *fast* path
that hands the packed integers to torch's kernels, which dequantise inside the dot product.

    python 16_quantization.py              # the formats on one matrix: bytes, error, time by rows
    python 16_quantization_demo.py         # the model-wide table: bytes, speed, perplexity, agreement
    python 16_quantization_demo.py --plot ch12-quant.png
    python 05_server.py --engine minivllm:LLM --quant int4
"""

from __future__ import annotations

import time

import torch

from minivllm import threads as cpu_threads
from minivllm.quantization import GROUP_SIZES, HalfWeight, Int4Weight, Int8Weight, W8A8Weight

# The formats, their weights and `quantize(model, ...)` live in minivllm/quantization.py.


def main() -> None:
    """Each format on one random layer of the default model's shape: bytes, and how far it lands."""
    import argparse

    parser = argparse.ArgumentParser(description="Chapter 12: weight formats on one matrix. "
                                                 "The model-wide table: python 16_quantization_demo.py")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 128], help="batch sizes to time")
    args = parser.parse_args()
    torch.manual_seed(0)
    w = torch.randn(1536, 576) * 0.02                      # an MLP matrix of SmolLM2-135M
    x = torch.randn(4, 576)
    exact = x @ w.T
    print(f"[one {w.shape[0]} x {w.shape[1]} matrix, 4 input rows]  format, bytes, max |error| of x @ Wᵀ")
    print(f"  {'float32':<10} {w.numel() * 4:>10,}   0")
    formats = {"bf16": lambda w: HalfWeight(w, torch.bfloat16), "int8": Int8Weight, "w8a8": W8A8Weight,
               f"int4 g{args.group_size}": lambda w: Int4Weight(w, args.group_size)}
    for name, make in formats.items():
        weight = make(w)
        err = (weight.matmul(x) - exact).abs().max().item()
        print(f"  {name:<10} {weight.nbytes:>10,}   {err:.2e}   ({w.numel() * 4 / weight.nbytes:.1f}x fewer bytes)")
    time_by_rows(formats, args.rows)


# --8<-- [start:rows]
def time_by_rows(formats: dict, rows: list[int], layers: int = 30) -> None:
    """x @ Wᵀ through `layers` different matrices (so that none stays in cache, as in a forward
    pass), for batches of 1 to 128 rows: a kernel that does float arithmetic per row grows with
    the rows, one that multiplies int8 by int8 grows far less."""
    ws = [torch.randn(3072, 576) * 0.02 for _ in range(layers)]       # gate_up of SmolLM2-135M
    weights = {"float32": ws, **{name: [make(w) for w in ws] for name, make in formats.items()}}
    print(f"\n[{layers} matrices of 3,072 x 576: ms for x @ Wᵀ through all of them, by rows of x; "
          f"{cpu_threads.cpu_name()}]")
    print("  rows " + "".join(f"{name:>11}" for name in weights))
    for n in rows:
        x = torch.randn(n, 576)
        times = []
        for name, ws_ in weights.items():
            def run():
                for w in ws_:
                    x @ w.T if isinstance(w, torch.Tensor) else w.matmul(x)
            run()                                           # first call: kernels chosen, pages touched
            t0 = time.perf_counter()
            for _ in range(5):
                run()
            times.append((time.perf_counter() - t0) / 5 * 1e3)
        print(f"  {n:4d} " + "".join(f"{t:11.2f}" for t in times))
# --8<-- [end:rows]


if __name__ == "__main__":
    main()
