"""Support: one team of CPU worker threads at a time, when an engine computes on its own thread.

torch runs its CPU kernels on OpenMP. Every thread that calls a parallel kernel gets its
*own* team of OpenMP workers, and the team stays alive, idle, after the work is done.
An engine loop thread (Chapter 9) or a generate thread (Chapter 1's streaming) computes
next to the main thread that loaded the model, so the process holds two teams. Once the
teams together hold more threads than the machine has cores, GNU OpenMP stops letting
its workers spin between kernels and puts them to sleep after every one (its
"throttled" mode). A decode step runs hundreds of small kernels; waking the workers for
each made an engine loop thread 1.8x slower than the same steps on the main thread on a
2-core machine (54 tokens/s against 99 on Chapter 9's mixed workload).

OpenMP 5 lets a thread hand its idle team back (`omp_pause_resource_all`); the next
parallel kernel on that thread builds a fresh one. So whoever passes work to a compute
thread first calls `release_idle_workers()`. Where torch's runtime has no such call
(another OpenMP, or none), it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

import torch

OMP_PAUSE_SOFT = 1   # free the threads; keep what a later team needs to start quickly


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP library torch's kernels run on: bundled with the wheel, or the system's."""
    bundled = Path(torch.__file__).parent / "lib"
    candidates = [*sorted(bundled.glob("libgomp*.so*")), *sorted(bundled.glob("libomp*")),
                  *sorted(bundled.glob("libiomp5*"))]
    candidates += [name for name in (ctypes.util.find_library("gomp"), ctypes.util.find_library("omp")) if name]
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(str(candidate))   # already loaded by torch: the same library, not a copy
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return lib
    return None


# --8<-- [start:release]
def release_idle_workers() -> bool:
    """Hand back the calling thread's idle OpenMP team; True if the runtime allowed it."""
    if not torch.backends.openmp.is_available():
        return False
    lib = _openmp_runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
# --8<-- [end:release]


def cpu_name() -> str:
    """The processor's name, for the header of a measurement (figures are only true of one machine)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {thread_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {thread_count()}"


def thread_count(n: int | None = None) -> str:
    """'1 CPU thread' or '4 CPU threads': torch's intra-op threads (or n), with the noun agreeing."""
    n = torch.get_num_threads() if n is None else n
    if n < 1:
        raise ValueError(f"a thread count is at least 1, got {n}")
    return f"{n} CPU thread{'' if n == 1 else 's'}"
