"""cli.py: the scripts' flags refuse bad values in one line, before any model loads."""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

cli = importlib.import_module("kit.cli")


def test_integer_bounds_and_types():
    parse = cli.integer(1, 10)
    assert parse("3") == 3
    for bad, why in (("0", "out of range: between 1 and 10"), ("11", "out of range"), ("1.5", "not an integer"),
                     ("nan", "not an integer"), ("", "not an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse(bad)
    assert cli.integer(0)("1000000") == 1000000


def test_number_is_finite_and_bounded():
    assert cli.number(above=0)("0.5") == 0.5
    for bad, why in (("nan", "not a finite number"), ("inf", "not a finite number"), ("0", "greater than 0"),
                     ("-1", "greater than 0"), ("x", "not a number")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            cli.number(above=0)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="between 0 and 16"):
        cli.number(0, 16)("17")


def test_output_file_is_checked_and_its_folder_made(tmp_path):
    target = tmp_path / "new" / "plot.png"
    assert cli.plot_file()(str(target)) == str(target) and target.parent.is_dir()
    for bad, why in ((str(tmp_path), "is a folder"), ("", "is a folder"), (str(tmp_path / "x.txt"), "should end in")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            cli.plot_file()(bad)
    assert cli.output_file()(str(tmp_path / "any.name")).endswith("any.name")


def test_memory_sizes_parse():
    assert cli.parse_bytes("512MB") == 512 << 20
    assert cli.parse_bytes("1.5GiB") == 3 << 29
    assert cli.parse_bytes("64m") == 64 << 20
    assert cli.parse_bytes(" 2 kb ") == 2048
    assert cli.parse_bytes("1000") == 1000
    assert cli.parse_bytes("1TB") == 1 << 40
    for bad in ("", "MB", "-5MB", "12XB", "1e9", "0", "2TB", "512 MB MB"):
        with pytest.raises(ValueError):
            cli.parse_bytes(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="not a memory size"):
        cli.byte_size("lots")


@pytest.mark.parametrize("argv, message", [
    (["09_static_batching.py", "--sizes", "0"], "argument --sizes: 0 is out of range"),
    (["13_continuous_batching_demo.py", "--rate", "nan"], "argument --rate: nan is not a finite number"),
    (["13_continuous_batching_demo.py", "--small", "--requests", "3"], "give either --small or those"),
    (["16_quantization_demo.py", "--rounds", "0"], "argument --rounds: 0 is out of range"),
    (["05_server.py", "--port", "70000"], "argument --port: 70000 is out of range"),
    (["05_server.py", "--host", ""], "--host must name an address"),
    (["05_server.py", "--request-timeout", "0"], "argument --request-timeout: 0 is out of range"),
    (["05_server.py", "--body-timeout", "1e9"], "argument --body-timeout: 1e+09 is out of range"),
    (["04_engine.py", "--device", "tpu"], "unknown device 'tpu'"),
    (["05_server.py", "--engine", ".x:Y"], "a spec must look like 'module:Class'"),
])
def test_scripts_refuse_bad_flags_in_one_line(argv, message):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_a_bare_plot_name_goes_into_the_ignored_plots_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.plot_file()("kv.png") == str(Path("plots") / "kv.png") and (tmp_path / "plots").is_dir()
    gitignore = (Path(__file__).resolve().parent.parent / ".gitignore").read_text().split()
    assert "plots/" in gitignore
