"""cpu_threads.release_idle_workers: the calling thread's idle OpenMP team really goes, and torch still works."""

from __future__ import annotations

import importlib

import os
import sys
import threading
import time

import pytest
import torch


cpu_threads = importlib.import_module("minivllm.threads")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_work() -> torch.Tensor:
    a = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) / 1e5
    return a @ a   # big enough for torch to open a parallel region on every thread


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.get_num_threads() < 2
                    or not torch.backends.openmp.is_available(),
                    reason="needs Linux (/proc), torch on OpenMP and at least two CPU threads")
def test_release_frees_this_threads_team_and_torch_keeps_working():
    expected = parallel_work()
    with_team = os_threads()
    assert cpu_threads.release_idle_workers() is True
    deadline = time.monotonic() + 5
    while os_threads() >= with_team and time.monotonic() < deadline:   # the workers exit on their own
        time.sleep(0.01)
    assert os_threads() < with_team, "the idle OpenMP workers are still there"
    assert torch.equal(parallel_work(), expected)     # a fresh team, the same arithmetic

    results = []
    worker = threading.Thread(target=lambda: results.append(parallel_work()))
    worker.start()
    worker.join()
    assert torch.equal(results[0], expected)


def test_release_is_harmless_without_a_team_and_repeatable():
    for _ in range(3):
        assert cpu_threads.release_idle_workers() in (True, False)
    assert torch.equal(parallel_work(), parallel_work())


def test_a_thread_count_reads_in_the_singular_and_the_plural():
    from minivllm.threads import thread_count

    assert (thread_count(1), thread_count(2)) == ("1 CPU thread", "2 CPU threads")
    with pytest.raises(ValueError):
        thread_count(0)
