"""In front of a class: the batching engine by default, a warning for an open server, a quiet log,
and one --threads flag on every entry point, read from the options table."""

from __future__ import annotations

import sys

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import load_script, parser_of
from kit import cli, console
from kit import server_ops as ops_lib
from minivllm import LLM
from minivllm.config import EngineConfig

server = load_script("05_server")


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("script", ["04_engine", "05_server", "06_benchmark_offline"])
def test_threads_is_a_flag_of_the_first_scripts_and_sets_torchs_threads(script, monkeypatch, keep_threads):
    parser = parser_of(script, monkeypatch)
    row = EngineConfig.table()["threads"][1]
    [action] = [a for a in parser._actions if "--threads" in a.option_strings]
    assert row.help in action.help          # the table's row, not a flag of its own
    torch.set_num_threads(2)
    args, _ = parser.parse_known_args(["--threads", "1"])
    assert torch.get_num_threads() == 1 and args.threads == 1
    assert "threads" not in cli.engine_options(args)   # the process's, so Chapter 1's engine runs on it too
    with pytest.raises(SystemExit):
        parser.parse_known_args(["--threads", "0"])


def test_llm_takes_threads(tiny_model_dir, keep_threads):
    with pytest.raises(ValueError, match=r"threads must be an integer in \[1, 1024\]"):
        LLM(str(tiny_model_dir), device="cpu", threads=0)
    torch.set_num_threads(2)
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=2 << 20, threads=1) as llm:
        assert torch.get_num_threads() == 1 and llm.config.threads == 1


def test_minivllm_serve_serves_the_batching_engine(monkeypatch):
    ran = []
    monkeypatch.setattr(console, "_run", lambda script: ran.append((script, list(sys.argv[1:]))))
    monkeypatch.delenv("ENGINE_CLASS", raising=False)
    monkeypatch.setattr(sys, "argv", ["minivllm-serve", "--port", "9000"])
    console.serve()
    assert ran[-1] == ("05_server.py", ["--engine", "minivllm:LLM", "--port", "9000"])
    monkeypatch.setattr(sys, "argv", ["minivllm-serve", "--engine=04_engine:BaselineEngine"])
    console.serve()
    assert ran[-1][1] == ["--engine=04_engine:BaselineEngine"]   # a named engine wins
    server_args = server.arguments().parse_args(ran[0][1])
    assert server_args.engine == "minivllm:LLM"


def test_the_readme_classroom_recipe_serves_the_batching_engine():
    from conftest import REPO_ROOT
    readme = (REPO_ROOT / "README.md").read_text()
    recipe = [line for line in readme.splitlines() if "05_server.py --host 0.0.0.0" in line]
    assert recipe and all("--engine minivllm:LLM" in line and "--api-key" in line for line in recipe)


def test_an_open_server_beyond_loopback_warns_as_it_starts():
    lan = lambda family: ["192.168.1.20"]  # noqa: E731
    for host in ("0.0.0.0", "192.168.1.20", "::"):
        assert "WARNING" in ops_lib.startup_lines("minivllm:LLM", host, 8001, None, lan), host
        assert "WARNING" not in ops_lib.startup_lines("minivllm:LLM", host, 8001, "k", lan), host
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert "WARNING" not in ops_lib.startup_lines("minivllm:LLM", host, 8001, None, lan), host


def test_the_access_log_is_off_unless_asked(tiny_engine, caplog):
    def lines(ops):
        caplog.clear()
        with TestClient(server.make_app(tiny_engine, ops=ops)) as c, \
                caplog.at_level("INFO", logger="05_server.access"):
            c.get("/health")
            c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        return [r for r in caplog.records if r.name == "05_server.access"]
    assert lines(ops_lib.ServerOps()) == []
    assert len(lines(ops_lib.ServerOps(access_log=True))) == 2
    args = server.arguments().parse_args(["--access-log"])
    assert ops_lib.ServerOps.from_args(args).access_log
    assert not ops_lib.ServerOps.from_args(server.arguments().parse_args([])).access_log
