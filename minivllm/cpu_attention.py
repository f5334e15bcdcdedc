"""Chapter 13: a C++ kernel for decode attention over the paged pool, read in place.

Chapter 7's decode rows attend by copying every row's blocks into one padded rectangle, in
every layer of every step, and handing the copy to SDPA: the cache, most of a long decode
step's bytes, is read twice and written once. `csrc/paged_attention_cpu.cpp` reads each key and
value once, where it lies, through the block table (vLLM's CPU backend has a kernel of this
kind; ours is the plain version: one task per sequence and KV head, split over torch's threads).

The kernel is compiled on first use by torch's C++ extension builder (g++ and ninja, about 20 s;
later processes load it from torch's extension cache). Where it cannot be built, or on a pool it
does not handle (not float32, not on the CPU), `available()` says no and the engine keeps the
copy and SDPA; the reason is printed once.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
_lock, _module, _failure = threading.Lock(), None, None


def _build():
    """The compiled extension, built once per process (and once per machine: torch caches it)."""
    global _module, _failure
    if _module is not None or _failure is not None:   # decided already: no lock on every layer's call
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                from torch.utils.cpp_extension import load_inline
                if shutil.which("ninja") is None:   # a venv's python run without activating the venv
                    import ninja
                    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
                print("[kernel] loading the paged attention kernel (the first time it is compiled: ~20 s)",
                      flush=True)
                _module = load_inline("minivllm_paged_attention_cpu", SOURCE.read_text(),
                                      functions=["paged_decode_attention"],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp-simd"])
            except Exception as exc:   # no compiler, no ninja, no headers: the copy + SDPA path stays
                first_line = (str(exc).strip().splitlines() or [""])[0]
                _failure = f"{type(exc).__name__}: {first_line[:160]}"
                print(f"[kernel] paged attention kernel unavailable, decode attention copies its blocks "
                      f"instead ({_failure})", flush=True)
    return _module


def available(pool_k: torch.Tensor) -> bool:
    """Whether decode rows over this pool can use the kernel (building it if need be)."""
    return pool_k.device.type == "cpu" and pool_k.dtype == torch.float32 and _build() is not None


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """q [seqs, heads, head_dim] against pools [slots, kv_heads, head_dim] through block_tables
    [seqs, width]; context_lens [seqs] positions each. Returns [seqs, heads * head_dim], the
    same as minivllm.compile.paged_decode_attention (its plain-torch form)."""
    module = _build()
    if module is None:
        raise RuntimeError(f"the paged attention kernel is unavailable: {_failure}")
    out = module.paged_decode_attention(q.float(), k_pool, v_pool, block_tables.long(), context_lens.long(),
                                        int(block_size))
    return out.view(q.shape[0], -1)
