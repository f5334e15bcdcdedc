"""Chapter 15: how big a KV pool a GPU can hold, after the weights.

On a CPU the pool has a fixed size (`kv_memory`, 512 MiB by default): host memory is large and
shared with everything else. A GPU's memory is the engine's alone and small next to what a busy
engine could use, so vLLM turns it around: the engine may use a fraction of the device
(`gpu_memory_utilization`, 0.9 by default) and the pool gets whatever of that fraction the
weights and a step's working memory leave. More blocks means more sequences at once, which is
what throughput on a GPU is made of.

    budget      utilization x the device's total memory
    taken       what is in use when the weights have loaded: this process's weights, and
                whatever else runs on the device (another process counts against us too)
    headroom    what else the engine holds or allocates while it runs, counted by parts
                (`headroom_parts`): the largest eager step's activations (a prefill chunk of
                max_num_batched_tokens, the context it gathers, its logits); with CUDA graphs
                their one logits buffer and the pool their recorded temporaries keep (the
                graphs' pool is theirs alone: eager steps cannot borrow it); a fixed part for
                the CUDA context and cuBLAS's workspaces
    pool        budget - taken - headroom, refused if it would not hold one block
"""

from __future__ import annotations

import torch

from minivllm.model import ModelConfig

FIXED_HEADROOM = 512 << 20              # CUDA context, cuBLAS workspaces, fragmentation


# --8<-- [start:size]
def headroom_parts(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype,
                   max_model_len: int | None = None, graphs: bool = False) -> dict[str, int]:
    """Bytes the engine may hold besides weights and KV pool, part by part, at the largest step
    the scheduler builds. Per token fed: a few copies of the hidden states, the QKV projection and
    the MLP's widest activation; per row, the keys and values of one layer gathered up to the
    longest context (eager attention reads a copy), and its logits (the head's dtype, then two
    float32 copies as sampling works). Graphs keep their logits buffer and their largest bucket's
    temporaries (a decode step: one token a row, attention in place, so no gathered copy)."""
    size = torch.empty((), dtype=dtype).element_size()
    c = config
    context = max_model_len or c.max_position_embeddings
    per_token = (4 * c.hidden_size + 3 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * size
    logits_per_row = c.vocab_size * (size + 2 * 4)
    rows = min(max_num_seqs, max_num_batched_tokens)    # a step feeds at least one token a row
    parts = {
        "prefill activations": max_num_batched_tokens * per_token,
        "gathered context": rows * context * c.kv_bytes_per_token(dtype) // c.num_layers,   # one layer at a time
        "step logits": rows * logits_per_row,
        "fixed (CUDA context, workspaces)": FIXED_HEADROOM,
    }
    if graphs:
        parts["graph logits buffer"] = max_num_seqs * c.vocab_size * 4         # one, shared by every bucket
        parts["graph pool"] = max_num_seqs * (per_token + c.vocab_size * (size + 4))
    return parts


def step_headroom(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype,
                  max_model_len: int | None = None, graphs: bool = False) -> int:
    """The headroom's parts, added up."""
    return sum(headroom_parts(config, max_num_batched_tokens, max_num_seqs, dtype, max_model_len, graphs).values())


def kv_memory_left(device: torch.device, utilization: float, headroom: int) -> int:
    """Bytes the KV pool may take on this GPU now that the weights are in (see the module's
    docstring). Read from the device itself: call it after loading the weights."""
    free, total = torch.cuda.mem_get_info(device)
    pool = int(total * utilization) - (total - free) - headroom
    if pool <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no room for a KV pool on this GPU: "
                         f"{total / 2**30:.1f} GiB in all, {(total - free) / 2**30:.1f} GiB in use once the "
                         f"weights loaded, {headroom / 2**30:.1f} GiB kept for a step; raise it, or pass "
                         f"kv_memory explicitly")
    return pool
# --8<-- [end:size]
