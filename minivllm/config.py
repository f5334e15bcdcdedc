"""Every option of the assembled engine, its default and its bounds, in one place.

Each chapter adds a feature; each feature is one keyword of `LLM(...)` and the flag of the
same name on the server and both benchmarks (`--kv-memory` is `kv_memory=`). This module is
data and checks only (it imports no feature), so every chapter may read it, and `kit/cli.py`
builds its flags from the same table: a bound written once cannot drift between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# --8<-- [start:options]
QUANT_FORMATS = ("bf16", "int8", "w8a8", "int4")                        # Chapter 12
GROUP_SIZES = (32, 64, 128, 256)                                # int4: what torch's kernels accept
QUANT_HEADS = ("auto", "f32", "bf16", "fp16", "int8", "int4")
SPECULATIVE_METHODS = ("ngram", "draft")                        # Chapter 10
MAX_SPECULATIVE_TOKENS = 16
MAX_SEQS = 65536                                                # Chapter 9: sequences, and tokens, in one step
MAX_BLOCK_SIZE = 1024                                           # Chapter 7: tokens per KV block
MAX_TENSOR_PARALLEL = 64                                        # Chapter 14: processes
DEFAULT_KV_MEMORY = 512 << 20                                   # 728 blocks of 16: 11,648 tokens of the default model
DEFAULT_BLOCK_SIZE = 16                                         # vLLM's default
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9                            # Chapter 15: vLLM's default fraction of a GPU


@dataclass(frozen=True)
class EngineConfig:
    """The assembled engine's options, checked at construction: a bad one is a ValueError before
    any weights load, with the option's name and its bounds."""

    kv_memory: int | None = None                # bytes of KV pool (Chapter 7); None: DEFAULT_KV_MEMORY,
                                                # on one GPU what gpu_memory_utilization leaves (Chapter 15)
    block_size: int = DEFAULT_BLOCK_SIZE        # tokens per block (Chapter 7)
    prefix_caching: bool = False                # share the blocks of prompt prefixes seen before (Chapter 8)
    max_num_seqs: int = 32                      # sequences in one step, at most (Chapter 9)
    max_num_batched_tokens: int = 256           # tokens in one step, at most: the prefill chunk (Chapter 9)
    speculative: str | None = None              # "ngram" or "draft" (Chapter 10)
    num_speculative_tokens: int = 4
    draft_model: str | None = None              # default: this model on int4 weights
    quant: str | None = None                    # None (the model's own), "bf16", "int8", "w8a8", "int4" (Chapter 12)
    group_size: int = 32
    quant_head: str = "auto"
    compile: bool = False                       # packed weights, fused ops (Chapter 13)
    tensor_parallel_size: int | None = None     # N processes (Chapter 14); None: one process, no group
    enforce_eager: bool | None = None           # True: no CUDA graphs; False: graphs (on the CPU, their
                                                # padded path, run eagerly); None: graphs on CUDA (Chapter 15)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION   # the share of a GPU it may use (Ch. 15)

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or \
                    (high is not None and value > high):
                bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be an integer {'in ' if high else ''}{bounds}, got {value!r}")

        def choice(name: str, options: tuple, none: bool = False) -> None:
            value = getattr(self, name)
            if not (value is None and none) and value not in options:
                raise ValueError(f"{name} must be one of {', '.join(map(str, options))}"
                                 f"{' (or None)' if none else ''}, got {value!r}")

        if self.kv_memory is not None:
            integer("kv_memory", 1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        integer("block_size", 1, MAX_BLOCK_SIZE)
        integer("max_num_seqs", 1, MAX_SEQS)
        integer("max_num_batched_tokens", 1, MAX_SEQS)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token each step")
        for name in ("prefix_caching", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        choice("speculative", SPECULATIVE_METHODS, none=True)
        integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError("draft_model needs speculative='draft'")
        choice("quant", QUANT_FORMATS, none=True)
        choice("group_size", GROUP_SIZES)
        choice("quant_head", QUANT_HEADS)
        if self.tensor_parallel_size is not None:
            integer("tensor_parallel_size", 1, MAX_TENSOR_PARALLEL)
        if not isinstance(self.enforce_eager, (bool, type(None))):
            raise ValueError(f"enforce_eager must be True, False or None, got {self.enforce_eager!r}")
        eager_only = [name for name in ("compile", "speculative", "tensor_parallel_size") if getattr(self, name)]
        if self.enforce_eager is False and eager_only:
            raise ValueError(f"enforce_eager=False (CUDA graphs, Chapter 15) does not combine with "
                             f"{', '.join(eager_only)}: those steps run eagerly")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
# --8<-- [end:options]
