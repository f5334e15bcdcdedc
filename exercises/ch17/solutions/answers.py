"""Chapter 17 exercises: adapters beside the base weights (minivllm/lora.py, 21_adapters.py) (solutions)."""

import torch


# Exercise 17.1 (predict, then measure). A rank-8 LoRA adapter on all seven projections (q, k, v,
# o, gate, up, down) of every layer of SmolLM2-135M (30 layers, hidden size 576, 3 KV heads of
# 64, MLP width 1536): how many parameters does it add? Tolerance: 1%.
# why: a module of fan-in i and fan-out o adds r·(i + o). Per layer: q and o 8·1152 each, k and v
# 8·(576 + 192) each, gate, up and down 8·(576 + 1536) each: 81,408; times 30 layers, about 2.44 M
# (under 2% of the base's 135 M, 9.8 MB in float32).
ADAPTER_PARAMS = 30 * 8 * (2 * 1152 + 2 * 768 + 3 * 2112)


# Exercise 17.2 (predict, then measure). One adapter file, r = 16 and lora_alpha = 32, read once
# as plain LoRA and once with use_rslora: true. By what factor is the rsLoRA update
# (x·Aᵀ·Bᵀ·scale) larger? Tolerance: 0.1%.
# why: plain LoRA scales by alpha / r = 2, rsLoRA by alpha / sqrt(r) = 8: a factor of sqrt(16).
RSLORA_OVER_PLAIN = 4.0


def lora_delta(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exercise 17.3 (extend): the many-adapters step, shrink then expand. x is [T, in], one row
    per token; slots[t] is the device slot of token t's adapter, or -1 for the base model; a is
    [S, r, in] and b is [S, out, r] (scale folded into b), one adapter per slot. Return the
    [T, out] update x·Aᵀ·Bᵀ of each token's own adapter, exactly zero for base rows, without a
    Python loop over tokens (a loop over the S slots is fine). Checked against the adapter
    applied row by row, on random rows and slots."""
    # why: gather each slot's rows, shrink them to r numbers, expand back, and add them in place;
    # base rows are never gathered, so they cost nothing and stay zero (Punica's SGMV, in PyTorch).
    out = x.new_zeros(x.shape[0], b.shape[1])
    for s in range(a.shape[0]):
        rows = (slots == s).nonzero().flatten()
        if rows.numel():
            out.index_add_(0, rows, (x[rows] @ a[s].T) @ b[s].T)
    return out


def check_adapters_keep_their_blocks(case) -> None:
    """Exercise 17.4 (find the bug): case is (llm, prompt, lora) — an LLM with prefix caching and
    enable_lora, a prompt of several blocks, a LoRARequest. Raise AssertionError if a request with
    the adapter reuses KV blocks the base model computed for the same prompt (their keys and
    values differ: the adapter changes q, k and v). Called on the real engine and on one with a
    defect planted."""
    # why: the request's metrics count the prompt tokens it found cached; after the base model has
    # just filled the cache with this prompt, an adapter's request must find none of them.
    from minivllm.contracts import SamplingParams

    llm, prompt, lora = case
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(prompt, params)
    tuned = llm.generate(prompt, params, lora_request=lora)
    assert tuned.metrics.cached_tokens == 0, f"the adapter reused {tuned.metrics.cached_tokens} base tokens"
