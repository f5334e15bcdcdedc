"""kit/peers.py - vLLM's CPU build as one more row of the offline benchmark: same machine, same requests.

A speed-up over our own baseline says how far the book's engines came; a ratio against vLLM,
the engine this project measures itself against, says how far they still are. vLLM is never a
dependency: `scripts/peers/install_vllm.sh` puts its CPU build in a venv of its own, and the
benchmark runs that venv's python on `scripts/peers/vllm_offline.py` as a subprocess, with
the workload our engines get written to a JSON file (every prompt with its own max_tokens).

vLLM's script runs the workload three times in one process and prints the median output
tokens/s. With ignore_eos every request generates exactly its budget, so the tokens are
known and the wall time of that median pass is tokens / rate: vLLM's row gets the benchmark's
throughput lines (output tokens/s, requests/s, wall time) and none of its latency lines.

    python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos \\
        --engine minivllm:LLM --peer vllm
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit import cli
from kit.bench import BenchStats, RequestRecord
from kit.workloads import REPO_ROOT, WorkItem
from minivllm.threads import thread_count

PEERS = ("vllm",)
DEFAULT_VENV = "/tmp/peers/vllm"
# Engine keywords vLLM's script can mirror, and its flag for each; any other is not passed on.
MIRRORED = {"prefix_caching": "--prefix-caching", "max_num_batched_tokens": "--max-num-batched-tokens"}
PR_SET_PDEATHSIG = 1
_WORKLOAD_LINE = re.compile(r"workload: (\d+) requests, output tokens/s median ([0-9.]+) \(runs \[([^\]]*)\]\)")


class PeerUnavailable(Exception):
    """The peer is not installed here: the message says how to install it."""


class PeerFailed(RuntimeError):
    """The peer ran and failed (or timed out): the message holds the end of what it printed."""


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("peer: vLLM's CPU build on the same requests (outside the project)")
    g.add_argument("--peer", choices=PEERS, default=None,
                   help="also run vLLM's CPU build on this workload, in its own venv, alternating with our engines")
    g.add_argument("--peer-venv", default=None,
                   help=f"the venv holding vLLM (default: $VLLM_VENV or {DEFAULT_VENV})")
    g.add_argument("--peer-timeout", type=cli.number(above=0, high=86_400), default=1800,
                   help="seconds one vLLM run may take, model loading included (default 1800)")


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """--peer needs equal work; a peer that is not installed is said at once, not after the run,
    and dropped: our engines are measured all the same."""
    if args.peer and not args.ignore_eos:
        parser.error("--peer: vLLM's script always generates each request's whole budget; "
                     "add --ignore-eos so that our engines do the same work")
    problem = args.peer and missing(args.peer_venv)
    if problem:
        print(f"[peer] {problem}\n[peer] measuring our engines only.", flush=True)
        args.peer = None


def peers_dir() -> Path:
    """Where install_vllm.sh and vllm_offline.py live: $PEERS_DIR, or the repository's scripts/peers."""
    return Path(os.environ.get("PEERS_DIR") or REPO_ROOT / "scripts" / "peers").expanduser()


def venv_dir(venv: str | None = None) -> Path:
    return Path(venv or os.environ.get("VLLM_VENV") or DEFAULT_VENV).expanduser()


def missing(venv: str | None = None) -> str | None:
    """Why vLLM cannot run here, with the command that fixes it; None when it can."""
    folder, scripts = venv_dir(venv), peers_dir()
    if not (scripts / "vllm_offline.py").is_file():
        return (f"vLLM peer: {scripts / 'vllm_offline.py'} not found. Set PEERS_DIR to the folder "
                f"that holds vllm_offline.py and install_vllm.sh.")
    if not os.access(folder / "bin" / "python", os.X_OK):
        return (f"vLLM peer: no vLLM venv at {folder}. Install vLLM's CPU build once (about 3 minutes, "
                f"2 GB, outside the project):\n    bash {scripts / 'install_vllm.sh'} {folder}\n"
                f"or point --peer-venv (or VLLM_VENV) at a venv that has it.")
    return None


def version(folder: Path) -> str:
    """vLLM's version from its install record, without importing it (that takes seconds)."""
    for record in sorted(folder.glob("lib/python*/site-packages/vllm*.dist-info")):
        return record.name.removesuffix(".dist-info").replace("_", "-").replace("-cpu-", "-cpu ")
    return "vLLM (version unknown)"


def write_workload(path: Path, items: list[WorkItem]) -> None:
    """The requests as vllm_offline.py reads them: each prompt with its own budget (ignore_eos, greedy)."""
    path.write_text(json.dumps([{"prompt": w.prompt, "max_tokens": w.max_new_tokens, "ignore_eos": True}
                                for w in items]))


def parse_rates(stdout: str, n: int) -> tuple[float, list[float]]:
    """The median output tokens/s and each pass's, from the 'workload:' line vllm_offline.py prints."""
    match = _WORKLOAD_LINE.search(stdout)
    if not match:
        raise PeerFailed(f"vLLM printed no 'workload:' line; it printed:\n{stdout[-2000:]}")
    if int(match.group(1)) != n:
        raise PeerFailed(f"vLLM ran {match.group(1)} requests, not the {n} it was given")
    median, runs = float(match.group(2)), [float(r) for r in match.group(3).split(",") if r.strip()]
    if median <= 0:
        raise PeerFailed(f"vLLM reported {median} tokens/s")
    return median, runs


def _die_with_parent() -> None:
    """In the child, before vLLM starts (Linux): the kernel kills it when the benchmark dies,
    however it dies (a kill, not only a Ctrl-C), rather than leave it computing on a shared machine."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_process(command: list[str], env: dict, timeout_s: float) -> str:
    """Run to the end and return stdout. A timeout, a Ctrl-C or any error here kills vLLM. It stays
    in our process group, so whoever stops the benchmark's group stops vLLM too."""
    proc = subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PeerFailed(f"vLLM took longer than {timeout_s:g} s (--peer-timeout)") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-12:])
        raise PeerFailed(f"vLLM exited with code {proc.returncode}:\n{tail}")
    return stdout


@dataclass
class VllmPeer:
    """vLLM's CPU build, run by our benchmark: one subprocess per measured run (its own warm-up)."""

    venv: Path
    model: str                      # the model folder our engines load
    threads: int                    # our torch threads: vLLM gets as many OpenMP threads
    timeout_s: float = 1800
    options: dict = field(default_factory=dict)   # our engines' keywords; those in MIRRORED are passed on
    tokenizer: object = None        # ours, for the prompt token counts vLLM's script does not print
    name: str = "vLLM"              # it loads, warms up and measures inside one subprocess
    error: str | None = None
    log: list = field(default_factory=list)   # the lines it printed, one per run

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self) -> dict:
        """README.md's variables: N threads, no pinning, 2 GiB of KV cache, one process, no hub."""
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(self.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def command(self, workload: Path) -> list[str]:
        flags = []
        for name, flag in MIRRORED.items():
            value = self.options.get(name)
            if value is True:
                flags.append(flag)
            elif value not in (None, False):
                flags += [flag, str(value)]
        return [str(self.python), str(peers_dir() / "vllm_offline.py"), self.model, str(workload), *flags]

    def describe(self) -> dict:
        return {"name": self.name, "version": version(self.venv), "venv": str(self.venv), "model": self.model,
                "threads": self.threads, "passed_on": {k: v for k, v in self.options.items() if k in MIRRORED},
                "not_passed_on": sorted(k for k in self.options if k not in MIRRORED),
                "prefix_caching": bool(self.options.get("prefix_caching")), "printed": self.log}

    def announce(self) -> str:
        return (f"[peer] {version(self.venv)} from {self.venv}, {thread_count(self.threads)}, prefix caching "
                f"{'on' if self.options.get('prefix_caching') else 'off'}; not passed on: "
                f"{', '.join(self.describe()['not_passed_on']) or 'nothing'}")

    def measure(self, items: list[WorkItem]) -> float:
        """One run of vllm_offline.py on these requests: the wall time of its median pass, in seconds."""
        with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
            workload = Path(tmp) / "workload.json"
            write_workload(workload, items)
            stdout = run_process(self.command(workload), self.env(), self.timeout_s)
        median, _ = parse_rates(stdout, len(items))
        self.log.append(_WORKLOAD_LINE.search(stdout).group(0))
        return sum(w.max_new_tokens for w in items) / median


def find(name: str, venv: str | None, model: str, threads: int, timeout_s: float, options: dict,
         tokenizer=None) -> VllmPeer:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    problem = missing(venv)
    if problem:
        raise PeerUnavailable(problem)
    return VllmPeer(venv_dir(venv), model, threads, timeout_s, dict(options), tokenizer)


# --8<-- [start:run-peer]
def run_peer(peer: VllmPeer, items: list[WorkItem], params, bar) -> tuple[list, float]:
    """The benchmark's runner for the peer: every request at once, as vLLM's LLM.generate takes them.

    Records carry the tokens (ignore_eos: exactly each budget) but no latency: vLLM's script
    times the whole pass only. After a failure the peer is skipped; the caller drops its row."""
    if peer.error:
        return [], 0.0
    t0 = time.perf_counter()
    try:
        seconds = peer.measure(items)
    except PeerFailed as exc:
        peer.error = f"{exc} (after {time.perf_counter() - t0:.0f} s)"
        return [], 0.0
    finally:
        bar.update(len(items))
    count = (lambda text: len(peer.tokenizer(text).input_ids)) if peer.tokenizer else (lambda text: 0)
    return [RequestRecord(None, count(w.prompt), w.max_new_tokens) for w in items], seconds
# --8<-- [end:run-peer]


def ratio_lines(all_stats: list[BenchStats], peer_name: str) -> list[str]:
    """vLLM against each of our engines on the three lines it shares with them."""
    peer = next(s for s in all_stats if s.name == peer_name)
    return [f"  {peer_name} / {s.name}: output_tokens/s {peer.output_tokens_per_s / s.output_tokens_per_s:.2f}x, "
            f"requests/s {peer.requests_per_s / s.requests_per_s:.2f}x, "
            f"duration_s {peer.duration_s / s.duration_s:.2f}x"
            for s in all_stats if s.name != peer_name and s.output_tokens_per_s and s.requests_per_s]
