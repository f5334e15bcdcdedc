"""16_quantization_engine.py - Chapter 12's engines: Chapter 6's engine on quantised weights.

    python 05_server.py --engine 16_quantization:Int4Engine
    ENGINE_QUANT=int4 ENGINE_GROUP_SIZE=32 ENGINE_QUANT_HEAD=int4 python 05_server.py --engine 16_quantization:QuantizedEngine
"""

from __future__ import annotations

import importlib
import os

import torch

engine10 = importlib.import_module("10_model_engine")
quant16 = importlib.import_module("16_quantization")


# --8<-- [start:engine]
class QuantizedEngine(engine10.ModelEngine):
    """Chapter 6's engine on a quantised model. 05_server and 06_benchmark build engines as
    Class(model, device=...), so the mode can also come from ENGINE_QUANT (default int8),
    ENGINE_GROUP_SIZE (default 32) and ENGINE_QUANT_HEAD (auto, f32, int8 or int4; default auto)."""

    default_quant: str | None = None   # subclasses below pin a mode for `--engine` specs

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 32,
                 kv_memory: int = engine10.DEFAULT_KV_MEMORY, quant: str | None = None,
                 group_size: int | None = None, head: str | None = None, path: str = "fast"):
        quant = quant or self.default_quant or os.environ.get("ENGINE_QUANT", "int8")
        try:
            group_size = int(group_size or os.environ.get("ENGINE_GROUP_SIZE", 32))
        except ValueError:
            raise ValueError(f"ENGINE_GROUP_SIZE must be an integer, got {os.environ['ENGINE_GROUP_SIZE']!r}")
        head = head or os.environ.get("ENGINE_QUANT_HEAD", "auto")
        quant16.check_settings(quant, group_size, head)   # refuse bad settings before loading anything
        super().__init__(model_name, device, dtype, max_batch_size, kv_memory)
        self.model = quant16.QuantizedModel.from_model(self.model, quant, group_size, head, path)
        self.quant = quant16.describe(quant, group_size, head)
        print(f"[engine] weights: {self.quant}, {self.model.weight_bytes / 1e6:.0f} MB", flush=True)
# --8<-- [end:engine]


class BF16Engine(QuantizedEngine):
    default_quant = "bf16"


class Int8Engine(QuantizedEngine):
    default_quant = "int8"


class Int4Engine(QuantizedEngine):
    default_quant = "int4"
