"""Every option of the assembled engine, once: its name, type, default, bounds, help, the chapter
that adds it and vLLM's name for it.

Each chapter adds a feature; each feature is one field of `EngineConfig` below, one keyword of
`LLM(...)` and the flag of the same name on the server and both benchmarks (`--kv-memory` is
`kv_memory=`). The field's metadata is the table: `EngineConfig.__post_init__` checks every value
against it, `kit/cli.py` builds every flag from it (its type, bounds, choices and help), and a test
holds `LLM`'s signature to it. This module is data and checks only (it imports no feature), so
every chapter may read it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

# --8<-- [start:constants]
QUANT_FORMATS = ("bf16", "fp16", "int8", "w8a8", "int4")        # Chapter 12: every format the package has
GROUP_SIZES = (32, 64, 128, 256)                                # int4: what torch's kernels accept
HEAD_FORMATS = ("auto", "f32", "bf16", "fp16", "int8", "int4")  # the embedding / LM head's format
SPECULATIVE_METHODS = ("ngram", "draft")                        # Chapter 10
MAX_SPECULATIVE_TOKENS = 16
MAX_SEQS = 65536                                                # Chapter 9: sequences, and tokens, in one step
MAX_BLOCK_SIZE = 1024                                           # Chapter 7: tokens per KV block
MAX_KV_MEMORY = 1 << 40                                         # 1 TiB: a typo, not a machine
MAX_TENSOR_PARALLEL = 64                                        # Chapter 14: processes
DEFAULT_KV_MEMORY = 512 << 20                                   # 728 blocks of 16: 11,648 tokens of the default model
DEFAULT_BLOCK_SIZE = 16                                         # vLLM's default
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9                            # Chapter 15: vLLM's default fraction of a GPU
MAX_LORAS, MAX_LORA_RANK, MAX_CPU_LORAS = 64, 512, 1024          # Chapter 17: adapters in device slots, in host memory
MAX_MODEL_LEN = 1 << 20                                         # tokens: a bound on the bound
SEED_RANGE = (0, 2**63 - 1)                                     # an engine's seed, as torch takes it
# vLLM's other quantization methods read checkpoints quantised elsewhere; this package quantises
# the model's own float weights as it loads them (Chapter 12), so those names have no meaning here.
FOREIGN_QUANTIZATIONS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "fp8", "fbgemm_fp8", "bitsandbytes",
                         "gguf", "squeezellm", "compressed-tensors", "experts_int8", "modelopt", "deepspeedfp",
                         "hqq", "aqlm", "mxfp4", "torchao")
MAX_THREADS = 1024                                              # torch's CPU threads: more than any machine here
# --8<-- [end:constants]


# --8<-- [start:option]
@dataclass(frozen=True)
class Option:
    """One row of the table. kind: 'int', 'bytes' (an int, written 512MB on the command line),
    'fraction' (a number in (0, 1]), 'flag' (True or False), 'switch' (True, False or None: the
    engine decides), 'choice' or 'text'. low/high bound an int; choices, a choice; none: None is
    allowed (it means "the engine's own default", said in help)."""

    kind: str
    help: str
    chapter: int
    low: int | None = None
    high: int | None = None
    choices: tuple = ()
    none: bool = False
    vllm: str | None = None          # vLLM's spelling, where it differs (or None: the same name)
    vllm_alias: bool = True          # vLLM's spelling is also accepted (LLM's keyword, a flag), same meaning

    @property
    def alias(self) -> str | None:
        """vLLM's spelling as a keyword this engine accepts too (None: none, or not one identifier)."""
        return self.vllm if self.vllm and self.vllm_alias and self.vllm.isidentifier() else None

    def check(self, name: str, value) -> None:
        """ValueError naming the option and what it accepts, unless value fits."""
        if value is None and (self.none or self.kind == "switch"):
            return
        if self.kind == "choice" and self.vllm == "quantization" and value in FOREIGN_QUANTIZATIONS:
            raise ValueError(f"{name} (vLLM's {self.vllm}) {value!r} reads a checkpoint quantised elsewhere, which this engine does "
                             f"not load: it quantises the model's own weights, to one of "
                             f"{', '.join(self.choices)} (int4 is the nearest to {value})")
        if self.kind in ("int", "bytes"):
            ok = isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high
            accepts = f"an integer in [{self.low}, {self.high}]"
        elif self.kind == "fraction":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and 0 < value <= 1
            accepts = "a number in (0, 1]"
        elif self.kind in ("flag", "switch"):
            ok, accepts = isinstance(value, bool), ("True, False or None" if self.kind == "switch" else "True or False")
        elif self.kind == "choice":
            ok, accepts = value in self.choices, "one of " + ", ".join(map(str, self.choices))
        else:
            ok, accepts = isinstance(value, str) and value != "", "a non-empty string"
        if not ok:
            raise ValueError(f"{name} must be {accepts}{' (or None)' if self.none else ''}, got {value!r}")


def option(default, kind: str, help: str, chapter: int, **row):
    """A field of EngineConfig with its row of the table."""
    return field(default=default, metadata={"option": Option(kind, help, chapter, **row)})


def parse_bytes(text: str) -> int:
    """'512MB', '1.5GiB', '64m' or a plain byte count -> bytes (MB = MiB here, as torch counts)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a memory size: {text!r} (try 512MB or 2GB)")
    value = float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")
    if not 1 <= value <= MAX_KV_MEMORY:
        raise ValueError(f"memory size {text!r} is out of range (1 byte .. 1 TiB)")
    return int(value)
# --8<-- [end:option]


# --8<-- [start:options]
@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The assembled engine's options, checked at construction: a bad one is a ValueError before
    any weights load, with the option's name and its bounds. Built by keyword only."""

    kv_memory: int | None = option(
        None, "bytes", "KV pool size in bytes (MB means MiB on the command line); default 512MB, on one GPU "
        "what gpu_memory_utilization leaves after the weights (Chapter 15)", 7,
        low=1, high=MAX_KV_MEMORY, none=True, vllm="kv_cache_memory_bytes")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "int", "tokens per KV block", 7, low=1, high=MAX_BLOCK_SIZE)
    prefix_caching: bool = option(
        False, "flag", "share the KV blocks of prompt prefixes seen before, among all clients unless their "
        "requests carry different cache_salt (vLLM's default is on, this engine's off: Chapter 8 turns it on)", 8,
        vllm="enable_prefix_caching")
    max_num_seqs: int = option(32, "int", "sequences in one step, at most", 9, low=1, high=MAX_SEQS)
    max_num_batched_tokens: int = option(
        256, "int", "tokens in one step, at most: the prefill chunk", 9, low=1, high=MAX_SEQS)
    speculative: str | None = option(
        None, "choice", "guess tokens and verify them in one step: ngram = prompt lookup, draft = a draft model",
        10, choices=SPECULATIVE_METHODS, none=True, vllm="speculative_config.method")
    num_speculative_tokens: int = option(
        4, "int", "guesses per verification, at most", 10, low=1, high=MAX_SPECULATIVE_TOKENS,
        vllm="speculative_config.num_speculative_tokens")
    draft_model: str | None = option(
        None, "text", "the draft model, same tokenizer (default: this model on int4 weights)", 10, none=True,
        vllm="speculative_config.model")
    quant: str | None = option(
        None, "choice", "weight format (default: the model's own float weights)", 12, choices=QUANT_FORMATS,
        none=True, vllm="quantization")
    group_size: int = option(32, "choice", "int4: inputs per scale and zero point", 12, choices=GROUP_SIZES)
    quant_head: str = option(
        "auto", "choice", "format of the embedding/LM head (auto: the layers', int8 for int4)", 12,
        choices=HEAD_FORMATS)
    compile: bool = option(
        False, "flag", "packed weights and fused ops via torch.compile; the first start compiles for a minute "
        "or two, later ones read inductor's cache", 13, vllm="compilation_config", vllm_alias=False)
    tensor_parallel_size: int | None = option(
        None, "int", "split the model over N processes: gloo on CPU, NCCL on N GPUs (default: one process, "
        "no group)", 14, low=1, high=MAX_TENSOR_PARALLEL, none=True)
    enforce_eager: bool | None = option(
        None, "switch", "no CUDA graphs: every decode step launches its kernels one by one (default: graphs "
        "on CUDA, eager elsewhere; False asks for the graphs' padded path on the CPU too)", 15)
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION, "fraction", "the share of the GPU's memory the engine may use, weights, "
        "KV pool and a step's activations together, when kv_memory is not given", 15)
    enable_lora: bool = option(False, "flag", "serve LoRA adapters beside the base weights, per request", 17)
    max_loras: int = option(1, "int", "adapters in one step, at most: the device slots", 17, low=1, high=MAX_LORAS)
    max_lora_rank: int = option(16, "int", "the highest adapter rank accepted (the slots' width)", 17,
                                low=1, high=MAX_LORA_RANK)
    max_cpu_loras: int | None = option(
        None, "int", "adapters held in host memory, at most (default: max_loras)", 17, low=1, high=MAX_CPU_LORAS,
        none=True)
    # vLLM's two engine-wide request settings (the same names)
    seed: int | None = option(
        None, "int", "the seed of every request that brings none: request i's is drawn from (seed, i), so a "
        "script run twice answers the same, each request independent of its batch mates (default: none)", 1,
        low=SEED_RANGE[0], high=SEED_RANGE[1], none=True)
    max_model_len: int | None = option(
        None, "int", "prompt and output tokens of one request together, at most (default: the model's context "
        "window)", 1, low=1, high=MAX_MODEL_LEN, none=True)
    threads: int | None = option(
        None, "int", "torch's CPU threads for the whole process, set before the model loads (default: torch's "
        "choice; 1 is steadier on a busy, shared machine)", 1, low=1, high=MAX_THREADS, none=True)

    def __post_init__(self) -> None:
        for f in fields(self):   # a size may come with its unit, as on the command line ("96MB")
            if f.metadata["option"].kind == "bytes" and isinstance(getattr(self, f.name), str):
                try:
                    object.__setattr__(self, f.name, parse_bytes(getattr(self, f.name)))
                except ValueError as exc:
                    raise ValueError(f"{f.name}: {exc}") from None
        for f in fields(self):
            f.metadata["option"].check(f.name, getattr(self, f.name))
        check_budgets(self.max_num_seqs, self.max_num_batched_tokens)
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError("draft_model needs speculative='draft'")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.speculative:   # Chapter 17
            raise ValueError("enable_lora does not combine with speculative: the guesses would be drafted and "
                             "verified without each request's adapter, so its output would not be the adapter's")
        eager_only = [name for name in ("compile", "speculative", "tensor_parallel_size")
                      if getattr(self, name)]
        if self.enforce_eager is False and eager_only:
            raise ValueError(f"enforce_eager=False (CUDA graphs, Chapter 15) does not combine with "
                             f"{', '.join(eager_only)}: those steps run eagerly")

    @property
    def pool_bytes(self) -> int:
        """The KV pool's size when it is fixed up front: the option, else the default."""
        return self.kv_memory if self.kv_memory is not None else DEFAULT_KV_MEMORY

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def vllm_names(cls) -> dict[str, str]:
        """vLLM's spelling -> ours, for every option whose vLLM name differs and means the same."""
        return {row.alias: f.name for f in fields(cls) if (row := f.metadata["option"]).alias}

    @classmethod
    def table(cls) -> dict[str, tuple[object, Option]]:
        """name -> (default, its row): what the flags, the docs and the tests read."""
        return {f.name: (f.default, f.metadata["option"]) for f in fields(cls)}
# --8<-- [end:options]


def check_option(name: str, value) -> None:
    """One option against its row, for a part built on its own (a SpeculativeDecoding, a WeightFormat)."""
    EngineConfig.table()[name][1].check(name, value)


def check_budgets(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """A step's two limits, each against its row, then together (a scheduler asks this too)."""
    check_option("max_num_seqs", max_num_seqs)
    check_option("max_num_batched_tokens", max_num_batched_tokens)
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                         f"({max_num_seqs}): every running sequence needs a token each step")
