"""16_quantization_engine.py - Chapter 12's engines: Chapter 6's engine on quantised weights.

A weight format is not a new engine: it is one more step of loading the model, a
`WeightFormat` handed to Chapter 6's engine (`weight_steps=`), or `quant=` on the assembled
`LLM`. These classes only pin a format, so that an `--engine` spec can name one:

    python 16_quantization_engine.py --quant int4          # one prompt, as 04_engine.py
    python 05_server.py --engine 16_quantization_engine:Int4Engine
    ENGINE_QUANT=int4 ENGINE_GROUP_SIZE=32 ENGINE_QUANT_HEAD=int4 python 05_server.py --engine 16_quantization_engine:QuantizedEngine
"""

from __future__ import annotations

import importlib
import os

import torch

from minivllm.quantization import WeightFormat

engine04 = importlib.import_module("04_engine")
engine10 = importlib.import_module("10_model_engine")


# --8<-- [start:engine]
class QuantizedEngine(engine10.ModelEngine):
    """Chapter 6's engine on a quantised model. The mode can also come from ENGINE_QUANT (default
    int8), ENGINE_GROUP_SIZE (default 32) and ENGINE_QUANT_HEAD (default auto), for servers and
    benchmarks started with nothing but an engine spec."""

    default_quant: str | None = None   # subclasses below pin a mode for `--engine` specs

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, max_num_seqs: int = 32,
                 kv_memory: int = engine10.DEFAULT_KV_MEMORY, quant: str | None = None,
                 group_size: int | None = None, quant_head: str | None = None, structured_output=None):
        quant = quant or self.default_quant or os.environ.get("ENGINE_QUANT", "int8")
        try:
            group_size = int(group_size or os.environ.get("ENGINE_GROUP_SIZE", 32))
        except ValueError:
            raise ValueError(f"ENGINE_GROUP_SIZE must be an integer, got {os.environ['ENGINE_GROUP_SIZE']!r}")
        quant_head = quant_head or os.environ.get("ENGINE_QUANT_HEAD", "auto")
        super().__init__(model_name, device, dtype, max_num_seqs, kv_memory,
                         [WeightFormat(quant, group_size, quant_head)], structured_output)
# --8<-- [end:engine]


class BF16Engine(QuantizedEngine):
    default_quant = "bf16"


class Int8Engine(QuantizedEngine):
    default_quant = "int8"


class Int4Engine(QuantizedEngine):
    default_quant = "int4"


def main() -> None:
    engine04.engine_main(QuantizedEngine, "Chapter 12: Chapter 6's engine on quantised weights (default int8).")


if __name__ == "__main__":
    main()
