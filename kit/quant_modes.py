"""kit/quant_modes.py - a weight format as the quantisation scripts name it on the command line.

Chapter 12's demo and its ceiling take a list of modes, one word each: `int8`, `int4-g64`,
`int4-g32-f32head` (the head kept in float32), `int4-g32-int4head` (packed in int4 too). A word
is the three settings of `minivllm.quantization.quantize`, checked before any weights load.
"""

from __future__ import annotations

from minivllm.quantization import HEAD_FORMATS, check_settings


def parse_mode(spec: str) -> tuple[str, int, str]:
    """'int4-g64-f32head' -> ('int4', 64, 'f32'): quant, group size, the head's format."""
    quant, *rest = spec.split("-")
    group, head, grouped = 32, "auto", False
    for part in rest:
        if part.startswith("g") and part[1:].isdigit():
            group, grouped = int(part[1:]), True
        elif part.endswith("head") and part.removesuffix("head") in HEAD_FORMATS:
            head = part.removesuffix("head")
        else:
            raise ValueError(f"cannot read mode {spec!r}: expected e.g. int8, int4-g64, int4-g32-f32head, "
                             f"int4-g32-int4head")
    check_settings(quant, group, head)
    if grouped and "int4" not in (quant, head):
        raise ValueError(f"mode {spec!r}: a group size only applies to int4 (layers or head)")
    return quant, group, head
