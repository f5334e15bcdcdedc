"""Chapter 17: an adapter's files, as peft saves them, read and checked against the model.

peft writes adapter_config.json (the rank, lora_alpha, target_modules, rsLoRA, the rank and
alpha patterns) beside adapter_model.safetensors (one lora_A and one lora_B per adapted module).
`read_adapter` reads both, checks every tensor against the model's shapes, folds the scale into
B, and refuses what cannot be applied beside the base weights, with the reason. The serving
itself, slots and steps, is in lora.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from minivllm.model import ModelConfig

MAX_NAME_CHARS = 256
# peft's module name -> (our fused weight, which part of its output)
PACKED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


# --8<-- [start:request]
@dataclass(frozen=True)
class LoRARequest:
    """vLLM's handle on an adapter: a name, an id >= 1 that identifies it, the folder peft saved."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not 0 < len(self.lora_name) <= MAX_NAME_CHARS:
            raise ValueError(f"lora_name must be 1 to {MAX_NAME_CHARS} characters, got {self.lora_name!r:.80}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ValueError(f"lora_path must be a folder, got {self.lora_path!r:.80}")
# --8<-- [end:request]


def module_sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each of peft's seven target modules in this model."""
    h, q, kv, f = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def pattern_value(patterns: dict, name: str, default):
    """peft's rank_pattern/alpha_pattern: the first key that names this module (a suffix of its
    full name, as peft matches it), else the default."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", name):
            return value
    return default


# --8<-- [start:load]
REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "layers_to_transform": "layers_to_transform",
           "fan_in_fan_out": "fan_in_fan_out", "layers_pattern": "layers_pattern"}


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> dict:
    """peft's files -> {(layer, module): (A [r, in], B·scale [out, r])}, every tensor checked
    against the model; what cannot be applied beside the base weights is refused, with why."""
    folder = Path(path)
    cfg_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{folder} is not a peft adapter: adapter_config.json and adapter_model.safetensors needed")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    refused = [why for key, why in REFUSED.items() if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        refused.append(f"bias={cfg['bias']!r}")
    if refused:
        raise ValueError(f"{folder}: cannot apply {', '.join(refused)} beside the base weights (plain LoRA only)")
    r0, alpha0, rs = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora"))
    sizes, tensors, out = module_sizes(config), load_file(weights_file), {}
    for key in tensors:
        m = TENSOR_NAME.match(key)
        if not m or m[2] not in PACKED:
            raise ValueError(f"{folder}: {key} adapts a module this engine cannot adapt (only the seven "
                             f"projections of each layer: {', '.join(PACKED)})")
        layer, module = int(m[1]), m[2]
        if layer >= config.num_layers:
            raise ValueError(f"{folder}: {key} names layer {layer}, the model has {config.num_layers}")
        if m[3] == "B":
            continue
        a, b = tensors[key], tensors.get(key[:-len("lora_A.weight")] + "lora_B.weight")
        name = f"model.layers.{layer}.{m[2]}"
        r = int(pattern_value(cfg.get("rank_pattern") or {}, name, r0))
        alpha = float(pattern_value(cfg.get("alpha_pattern") or {}, name, alpha0))
        fan_in, fan_out = sizes[module]
        if b is None or a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise ValueError(f"{folder}: {name} has A {tuple(a.shape)} and B "
                             f"{None if b is None else tuple(b.shape)}; this model and r={r} need "
                             f"{(r, fan_in)} and {(fan_out, r)}")
        if r > max_rank:
            raise ValueError(f"{folder}: {name} has rank {r}, above max_lora_rank={max_rank}")
        scale = alpha / math.sqrt(r) if rs else alpha / r      # rsLoRA keeps a rank-r update's size steady
        out[(layer, module)] = (a.float(), b.float() * scale)
    if not out:
        raise ValueError(f"{folder}: no LoRA weights (target_modules matched nothing?)")
    return out
# --8<-- [end:load]
