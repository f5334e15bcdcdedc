"""17_compile.py - Chapter 13: compiled steps. Same model, same arithmetic, fewer trips to memory.

Chapter 4's roofline says a decode step should cost about what reading its bytes costs. Our
eager step costs several times that, and the profile of Chapter 6 says where the rest goes:

    matmuls        the BLAS repacks each weight matrix on every call at a few rows (2 to 32)
    attention      every layer copies each sequence's KV blocks into one padded rectangle,
                   then SDPA reads the copy: the cache is read twice and written once
    glue           RMSNorm, RoPE, SiLU·mul and residual adds: a dozen small kernels a layer,
                   each reading and writing the whole activation

Three changes, none of which touches the model's arithmetic:

    packed weights  each matrix handed to oneDNN once, at load, in the blocked layout its
                    kernel reads (vLLM's CPU backend does the same); float32 and bf16
    paged attention a decode row's attention written as plain torch over its block table;
                    torch.compile turns it into one C++ loop that reads keys where they lie
                    (an option: on the CPU measured, Chapter 7's copy + SDPA was faster)
    fused glue      residual add + RMSNorm, RoPE on q and k, SiLU·mul: each one compiled
                    kernel instead of several

`compile_model(model)` applies them to any model Chapters 6, 12 and 14 build; `LLM` takes
`compile=True` (`--compile`) and hands the model runner a `Compile()` step after the weight
format. The code lives in `minivllm/compile.py`; this script checks it.

    python 17_compile.py                 # eager vs compiled: the same logits? the compile's cost
    python 17_compile_demo.py --part steps       # a step's time, eager vs compiled, batch 1 to 32
    python 17_compile_demo.py --plot ch13.png    # a step taken apart, every format, batch 1 and 32
    python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --compile \\
           --engine 13_continuous_batching_engine:ContinuousBatchingEngine --peer vllm
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from kit import cli
from minivllm import threads as cpu_threads
from minivllm.compile import (Compile, Compiled, CompiledModel, PackedWeight, add_rms_norm,  # noqa: F401
                              can_pack, compile_model, packed_weights, paged_decode_attention, rope_split,
                              silu_mul)
from minivllm.kv_cache import KVPool
from minivllm.llm import LLM
from minivllm.model import LlamaModel

setup = importlib.import_module("01_setup")


class CompiledEngine(LLM):
    """Chapter 9's assembled engine with compile=True: its own name, so that one benchmark run
    can put it beside the eager engine (`--engine 17_compile:CompiledEngine`)."""

    def __init__(self, *args, compile: bool = True, **kwargs):
        super().__init__(*args, compile=compile, **kwargs)


# ---------------------------------------------------------------- the demonstration
# --8<-- [start:show-kernel]
def generated_kernel(fn=silu_mul, *example) -> str:
    """The C++ inductor writes for one fused op: what `torch.compile` turned Python into."""
    from torch._inductor.utils import run_and_get_code

    example = example or (torch.randn(4, 2 * 1536),)
    _, sources = run_and_get_code(torch.compile(fn), *example)
    quotes = "'" * 3       # each kernel's source sits in an r-string of the generated module
    kernels = [part.split(quotes)[0] for part in sources[0].split("r" + quotes)[1:]]
    return "\n".join(kernels).strip()
# --8<-- [end:show-kernel]


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 13: eager vs compiled, on the same weights: the same "
                                                 "logits? Timings: 17_compile_demo.py")
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--show-kernel", action="store_true", help="only print the C++ generated for SiLU·mul")
    args = parser.parse_args()
    if args.show_kernel:
        with torch.inference_mode():
            print(generated_kernel())
        return
    engine04 = importlib.import_module("04_engine")
    folder = setup.resolve_model(args.model)
    eager = LlamaModel.from_folder(folder)
    compiled = compile_model(eager)
    c = eager.config
    pool = KVPool.from_memory(c, 2048 * c.kv_bytes_per_token(torch.float32))
    print(f"[{cpu_threads.cpu_name()}]  float32, torch {torch.__version__}")
    print(f"[weights]  eager {eager.weight_bytes / 1e6:.0f} MB; packed {compiled.weight_bytes / 1e6:.0f} MB "
          f"(the tied LM head gets a packed copy of its own)")
    seconds = compiled.warm_up(pool)
    print(f"[compile]  warm-up {seconds:.1f} s (inductor's cache: later starts reuse its kernels)")

    # --8<-- [start:check]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("\n[same logits?]  each reference prompt's prefill, then 32 greedy tokens fed to both")
    same, worst = 0, 0.0
    for prompt in engine04.reference_prompts():
        ids = tokenizer(prompt).input_ids
        runs = []
        for model in (eager, compiled):
            table, tokens, logits = list(range(-(-(len(ids) + 32) // pool.block_size))), list(ids), []
            for step in range(32):
                start = 0 if step == 0 else len(tokens) - 1
                out = model.forward(pool.batch([tokens[start:]], [table], [start], "cpu"), pool)
                logits.append(out[0])
                tokens.append(int(out[0].argmax()))
            runs.append((tokens[len(ids):], torch.stack(logits)))
        worst = max(worst, float((runs[0][1][0] - runs[1][1][0]).abs().max()))
        same += runs[0][0] == runs[1][0]
    print(f"  prefill logits: max |eager - compiled| = {worst:.1e}; greedy tokens identical on "
          f"{same} of {len(engine04.reference_prompts())} prompts")
    # --8<-- [end:check]



if __name__ == "__main__":
    main()
