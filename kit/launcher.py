"""kit/launcher.py - 05_server.py as a process of its own, for benchmarks, end-to-end tests and the book.

A server measured from inside its own process shares the interpreter (and its GIL) with
the client; the numbers a user sees come from a separate process over a real socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SERVER_SCRIPT = Path(__file__).resolve().parent.parent / "05_server.py"


def free_port() -> int:
    """A loopback port nobody is listening on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int, model: str | None = None, engine: str | None = None, device: str | None = None,
                   engine_options: dict | None = None, args: tuple[str, ...] = ()) -> list[str]:
    """The command line of 05_server.py. Engine options are the constructor keywords of
    kit.cli.engine_options, turned back into the flags they came from (kv_memory=268435456 ->
    --kv-memory 268435456, prefix_caching=True -> --prefix-caching)."""
    cmd = [sys.executable, str(SERVER_SCRIPT), "--host", "127.0.0.1", "--port", str(port)]
    for flag, value in (("--engine", engine), ("--model", model), ("--device", device)):
        cmd += [flag, value] if value else []   # omitted: the server's own default
    for name, value in (engine_options or {}).items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue                             # not given: the engine's own default, as on the command line
        if value is False:                       # a switch flag can only turn a feature on: refuse, never ignore
            raise ValueError(f"05_server.py's {flag} can only turn {name} on: leave it out for the engine's default")
        cmd += [flag] if value is True else [flag, str(value)]
    return cmd + list(args)


# --8<-- [start:subprocess]
@contextlib.contextmanager
def serve_in_subprocess(model: str | None = None, engine: str | None = None, device: str | None = None,
                        startup_timeout_s: float = 180.0, env: dict | None = None,
                        args: tuple[str, ...] = (), engine_options: dict | None = None) -> Iterator[str]:
    """Run 05_server.py as its own process on a free loopback port; yield its base URL.

    Waits until /health answers, and stops the server when the block ends, however it
    ends (an exception, Ctrl-C). Benchmarks, end-to-end tests and the book all use it.
    engine_options are the engine's feature keywords (kit.cli.engine_options), passed as flags.
    """
    port = free_port()
    cmd = server_command(port, model, engine, device, engine_options, args)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=SERVER_SCRIPT.parent,
                                env={**os.environ, **(env or {})})
        try:
            if not wait_until_healthy(url, proc, startup_timeout_s):
                log.seek(0)
                tail = "".join(log.readlines()[-15:])
                raise RuntimeError(f"the server ({engine or 'default engine'}) did not come up, exit code {proc.returncode}:\n{tail}")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> bool:
    """True once /health answers; False if the process ends or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
# --8<-- [end:subprocess]
