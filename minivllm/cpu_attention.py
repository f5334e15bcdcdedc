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

import hashlib
import os
import shutil
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
# -fopenmp: at::parallel_for splits the tasks over torch's OpenMP threads (without it, the pragma
# is ignored and the kernel runs on one thread). -ffast-math, at compile time only (so the process's
# handling of denormals is left alone): the softmax's exp becomes glibc's vector exp (libmvec) and
# its sums may be reordered. `python 17_compile.py --kernel` times the kernel without each.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_lock, _module, _failure = threading.Lock(), None, None


def compile_kernel(cflags: list[str] = CFLAGS):
    """Build the extension with these compiler flags, or load it from torch's cache (each set of
    flags is an extension of its own name, so that 17_compile.py --kernel can load several)."""
    from torch.utils.cpp_extension import load_inline
    if shutil.which("ninja") is None:   # a venv's python run without activating the venv
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = "minivllm_paged_attention_cpu"
    if cflags != CFLAGS:
        name += "_" + hashlib.sha1(" ".join(cflags).encode()).hexdigest()[:8]
    return load_inline(name, SOURCE.read_text(), functions=["paged_decode_attention", "parallel_threads"],
                       extra_cflags=cflags, extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [])


def _build():
    """The compiled extension, built once per process (and once per machine: torch caches it)."""
    global _module, _failure
    if _module is not None or _failure is not None:   # decided already: no lock on every layer's call
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                print("[kernel] loading the paged attention kernel (the first time it is compiled: ~20 s)",
                      flush=True)
                _module = compile_kernel()
            except Exception as exc:   # no compiler, no ninja, no headers: the copy + SDPA path stays
                first_line = (str(exc).strip().splitlines() or [""])[0]
                _failure = f"{type(exc).__name__}: {first_line[:160]}"
                print(f"[kernel] paged attention kernel unavailable, decode attention copies its blocks "
                      f"instead ({_failure})", flush=True)
    return _module


def _built():
    module = _build()
    if module is None:
        raise RuntimeError(f"the paged attention kernel is unavailable: {_failure}")
    return module


def available(pool_k: torch.Tensor) -> bool:
    """Whether decode rows over this pool can use the kernel (building it if need be)."""
    return pool_k.device.type == "cpu" and pool_k.dtype == torch.float32 and _build() is not None


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """q [seqs, heads, head_dim] against pools [slots, kv_heads, head_dim] through block_tables
    [seqs, width]; context_lens [seqs] positions each. Returns [seqs, heads * head_dim], the
    same as minivllm.compile.paged_decode_attention (its plain-torch form)."""
    out = _built().paged_decode_attention(q.float(), k_pool, v_pool, block_tables.long(), context_lens.long(),
                                        int(block_size))
    return out.view(q.shape[0], -1)


def parallel_threads() -> int:
    """How many threads the kernel's parallel loop runs on now (torch.get_num_threads(), when
    the build has OpenMP as it should)."""
    return _built().parallel_threads()
