"""08_kv_cache_sizes.py - what the KV cache costs in memory, from nothing but a model's config.

Every token a sequence holds keeps, in every layer, one key and one value vector per
key-value head:

    bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per number

This script reads the default model's config (no weights needed for the arithmetic),
checks the formula against the bytes of a real cache that the model fills, shows how
multi-head, grouped-query and multi-query attention change the answer, and prices
contexts of 2k, 32k and 128k tokens for this model and for Llama-3-8B and Llama-3-70B
in float32, bfloat16 and int8.

    python 08_kv_cache_sizes.py
    python 08_kv_cache_sizes.py --no-check        # the arithmetic only: no model is loaded
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, DynamicCache

from kit import cli
from kit.hf import cache_keyword
from minivllm.model_files import load_hf_model, pick_device, resolve_model
from minivllm.roofline import (LLAMA3_8B, LLAMA3_70B, as_config, head_dim, kv_bytes_per_token, num_kv_heads,
                                weight_bytes)

# The formula, the weights' bytes and the published Llama 3 configs: minivllm/roofline.py
CONTEXTS = (2048, 32768, 131072)
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


# --8<-- [start:measured]
def measured_cache_bytes(cache: DynamicCache) -> tuple[int, int]:
    """(bytes held in all layers' key and value tensors, tokens cached)."""
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total, cache.get_seq_length()


@torch.inference_mode()
def filled_cache(model, input_ids: torch.Tensor) -> DynamicCache:
    """The cache the model itself fills while it reads `input_ids` (a prefill)."""
    cache = DynamicCache()
    model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_keyword(type(model)): cache})
    return cache
# --8<-- [end:measured]


# --8<-- [start:variants]
def attention_variants(config) -> dict[str, int]:
    """KV heads under each attention design, for this model's query heads.

    multi-head (MHA): one KV head per query head; grouped-query (GQA): a few KV heads,
    each shared by a group of query heads (what the model has); multi-query (MQA): one."""
    return {"multi-head": config.num_attention_heads, "grouped-query": num_kv_heads(config), "multi-query": 1}
# --8<-- [end:variants]


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    return ""


def print_formula(name: str, config, dtype: torch.dtype) -> int:
    per_token = kv_bytes_per_token(config, dtype)
    print(f"[{name}]  {config.num_hidden_layers} layers, {config.num_attention_heads} query heads, "
          f"{num_kv_heads(config)} KV heads, head_dim {head_dim(config)}")
    print(f"  bytes per token, {str(dtype).removeprefix('torch.')}: 2 x {config.num_hidden_layers} x {num_kv_heads(config)}"
          f" x {head_dim(config)} x {torch.empty((), dtype=dtype).element_size()} = {per_token:,} ({human(per_token)})")
    return per_token


def print_variants(config, dtype: torch.dtype, context: int) -> None:
    heads = config.num_attention_heads
    print(f"\n[attention designs]  {heads} query heads, {str(dtype).removeprefix('torch.')}, "
          f"one sequence of {context:,} tokens")
    print(f"  {'design':<14}{'KV heads':>9}{'query heads/KV head':>21}{'per token':>13}{'per sequence':>14}")
    for design, n in attention_variants(config).items():
        per_token = kv_bytes_per_token(config, dtype, kv_heads=n)
        print(f"  {design:<14}{n:>9}{heads // n:>21}{human(per_token):>13}{human(per_token * context):>14}")


def print_contexts(models: dict[str, object]) -> None:
    print(f"\n[one sequence's KV cache]  contexts of {', '.join(f'{c // 1024}k' for c in CONTEXTS)} tokens")
    width = max(map(len, models)) + 2
    print(f"  {'model':<{width}}{'dtype':<9}{'per token':>12}" + "".join(f"{f'{c // 1024}k tokens':>14}" for c in CONTEXTS)
          + f"{'weights':>12}")
    for name, config in models.items():
        for label, dtype in DTYPES.items():
            per_token = kv_bytes_per_token(config, dtype)
            print(f"  {name:<{width}}{label:<9}{human(per_token):>12}"
                  + "".join(f"{human(per_token * c):>14}" for c in CONTEXTS)
                  + f"{human(weight_bytes(config, dtype)):>12}")
    longest = max(CONTEXTS)
    over = [f"{n} ({c.max_position_embeddings:,})" for n, c in models.items() if c.max_position_embeddings < longest]
    if over:
        print(f"  longer than these configs accept: {', '.join(over)};\n  those cells price a long-context"
              f" variant with the same layers and heads (as Llama 3.1 is for Llama 3)")


def main() -> None:
    parser = argparse.ArgumentParser(description="The KV cache's size from a model's config, checked.")
    cli.add_model_flags(parser)
    parser.add_argument("--no-check", action="store_true", help="skip loading the model to check the formula")
    args = parser.parse_args()
    try:
        folder = resolve_model(args.model)
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    name = str(folder).rstrip("/").rsplit("/", 1)[-1]
    # --8<-- [start:check]
    per_token = print_formula(name, config, torch.float32)
    if not args.no_check:
        tokenizer, model = load_hf_model(args.model, device=pick_device(args.device))
        ids = tokenizer("The KV cache grows by the same number of bytes with every token.",
                        return_tensors="pt").input_ids.to(model.device)
        held, tokens = measured_cache_bytes(filled_cache(model, ids))
        print(f"  measured: a prefill of {tokens} tokens left {held:,} bytes in the cache = {held // tokens:,}"
              f" bytes/token -> {'matches' if held == per_token * tokens else 'DIFFERS'}")
    # --8<-- [end:check]
    context = config.max_position_embeddings
    print(f"  at its full context of {context:,} tokens: {human(per_token * context)} per sequence"
          f" (weights: {human(weight_bytes(config, torch.float32))})")
    print_variants(config, torch.float32, context)
    print_contexts({name: config, "Llama-3-8B": as_config(LLAMA3_8B), "Llama-3-70B": as_config(LLAMA3_70B)})


if __name__ == "__main__":
    main()
