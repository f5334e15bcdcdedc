"""Chapter 17 exercises: adapters beside the base weights (minivllm/lora.py, 21_adapters.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch17
# (the shipped solutions are in solutions/answers.py: try first)

import torch


# Exercise 17.1 (predict, then measure). A rank-8 LoRA adapter on all seven projections (q, k, v,
# o, gate, up, down) of every layer of SmolLM2-135M (30 layers, hidden size 576, 3 KV heads of
# 64, MLP width 1536): how many parameters does it add? Tolerance: 1%.
ADAPTER_PARAMS = None


# Exercise 17.2 (predict, then measure). One adapter file, r = 16 and lora_alpha = 32, read once
# as plain LoRA and once with use_rslora: true. By what factor is the rsLoRA update
# (x·Aᵀ·Bᵀ·scale) larger? Tolerance: 0.1%.
RSLORA_OVER_PLAIN = None


def lora_delta(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exercise 17.3 (extend): the many-adapters step, shrink then expand. x is [T, in], one row
    per token; slots[t] is the device slot of token t's adapter, or -1 for the base model; a is
    [S, r, in] and b is [S, out, r] (scale folded into b), one adapter per slot. Return the
    [T, out] update x·Aᵀ·Bᵀ of each token's own adapter, exactly zero for base rows, without a
    Python loop over tokens (a loop over the S slots is fine). Checked against the adapter
    applied row by row, on random rows and slots."""
    raise NotImplementedError


def check_adapters_keep_their_blocks(case) -> None:
    """Exercise 17.4 (find the bug): case is (llm, prompt, lora) — an LLM with prefix caching and
    enable_lora, a prompt of several blocks, a LoRARequest. Raise AssertionError if a request with
    the adapter reuses KV blocks the base model computed for the same prompt (their keys and
    values differ: the adapter changes q, k and v). Called on the real engine and on one with a
    defect planted."""
    raise NotImplementedError
