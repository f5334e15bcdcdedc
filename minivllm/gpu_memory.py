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
    headroom    a step's activations and logits at the largest step the scheduler may build,
                plus the CUDA context and the graphs' memory pool
    pool        budget - taken - headroom, refused if it would not hold one block
"""

from __future__ import annotations

import torch

from minivllm.model import ModelConfig

FIXED_HEADROOM = 512 << 20              # CUDA context, cuBLAS workspaces, the graphs' pool, fragmentation


# --8<-- [start:size]
def step_headroom(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                  dtype: torch.dtype) -> int:
    """Bytes a step may hold besides weights and KV pool, for the largest step the scheduler
    builds: a few copies of the hidden states and the MLP's widest activation for every token
    fed, and float32 logits for every sequence, plus FIXED_HEADROOM."""
    size = torch.empty((), dtype=dtype).element_size()
    c = config
    per_token = (4 * c.hidden_size + 3 * c.intermediate_size
                 + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * size
    return max_num_batched_tokens * per_token + 2 * max_num_seqs * c.vocab_size * 4 + FIXED_HEADROOM


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
