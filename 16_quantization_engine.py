"""16_quantization_engine.py - Chapter 12's engine: Chapter 6's engine on quantised weights.

A weight format is not a new engine: it is one more step of loading the model, a
`WeightFormat` handed to Chapter 6's engine (`weight_steps=`), or `quant=` on the assembled
`LLM`. `QuantizedEngine` is Chapter 6's engine taking the format as keywords of its own, the
same keywords (and flags) as every later engine's: `quant` (int8 unless told), `group_size`
and `quant_head`:

    python 16_quantization_engine.py --quant int4          # one prompt, as 04_engine.py
    python 05_server.py --engine 16_quantization_engine:QuantizedEngine --quant int4
    python 06_benchmark_offline.py --ignore-eos --engine 10_model_engine:ModelEngine \\
        --engine "16_quantization_engine:QuantizedEngine --quant int8" \\
        --engine "16_quantization_engine:QuantizedEngine --quant int4 --group-size 64"

In a benchmark of several engines, flags inside an engine's quoted spec are its own: each
format is one more engine of the comparison.
"""

from __future__ import annotations

import importlib

import torch

from kit.demo import engine_main
from minivllm.config import EngineConfig
from minivllm.quantization import WeightFormat

engine10 = importlib.import_module("10_model_engine")

DEFAULTS = EngineConfig()   # group_size's and quant_head's defaults: the assembled engine's own


# --8<-- [start:engine]
class QuantizedEngine(engine10.ModelEngine):
    """Chapter 6's engine on a quantised model: quant is one of minivllm.config's formats, int8
    unless told; group_size and quant_head as the assembled engine takes them. A bad setting is
    a ValueError before any weights load."""

    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, max_num_seqs: int = 32,
                 kv_memory: int = engine10.DEFAULT_KV_MEMORY, quant: str = "int8",
                 group_size: int = DEFAULTS.group_size, quant_head: str = DEFAULTS.quant_head,
                 structured_output=None):
        super().__init__(model_name, device, dtype, max_num_seqs, kv_memory,
                         [WeightFormat(quant, group_size, quant_head)], structured_output)
# --8<-- [end:engine]


def main() -> None:
    engine_main(QuantizedEngine, "Chapter 12: Chapter 6's engine on quantised weights (default int8).")


if __name__ == "__main__":
    main()
