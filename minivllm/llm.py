"""The composition root: `LLM`, the engine with every feature, wired here with ordinary imports.

Every other module of the package imports only its own chapter or earlier ones; this one is
where the chapters meet. Each option becomes an object handed to the part that uses it:

    quant, group_size, quant_head   a WeightFormat, one step of load_model      (Chapter 12)
    compile                         Compile, the step after it                  (Chapter 13)
    tensor_parallel_size            TensorParallel: a group of processes whose runner
                                    loads every rank with the steps above       (Chapter 14)
    speculative, ...                SpeculativeDecoding: a runner that guesses and verifies (Chapter 10)
    prefix_caching                  the block manager that remembers            (Chapter 8)
    structured output               StructuredOutput, handed to the output processor (Chapter 11)
    enforce_eager                   CUDAGraphs, the model runner's decode steps (Chapter 15)

    from minivllm import LLM, SamplingParams
    with LLM(quant="int8", prefix_caching=True) as llm:
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=16)).text)
        print(llm.chat([{"role": "user", "content": "Hi!"}]).text)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minivllm.block_manager import BlockManager
from minivllm.compile import Compile
from minivllm.config import EngineConfig
from minivllm.contracts import GenerateResult, SamplingParams
from minivllm.cuda_graphs import CUDAGraphRunner, CUDAGraphs
from minivllm.engine import LLMEngine
from minivllm.gpu_memory import kv_memory_left, step_headroom
from minivllm.kv_cache import KVPool, blocks_in, describe_pool
from minivllm.model import ModelConfig
from minivllm.model_files import (DEFAULT_MODEL, eos_token_ids, load_tokenizer, model_folder, pick_device,
                                  pick_dtype)
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import OutputProcessor, Request
from minivllm.parallel_workers import TensorParallel, TensorParallelRunner
from minivllm.prefix_cache import PrefixCachingBlockManager
from minivllm.quantization import WeightFormat
from minivllm.scheduler import Scheduler
from minivllm.speculative import SpeculativeDecoding, Speculator
from minivllm.structured import StructuredOutput
from minivllm.text import chat_ids

DEFAULT_MAX_TOKENS = 128   # a request's budget when neither max_new_tokens nor SamplingParams.max_tokens says


# --8<-- [start:features]
def weight_steps(config: EngineConfig) -> list:
    """What load_model does to the weights after reading them, in order: the format, then
    compiled steps over the format's weights."""
    steps = []
    if config.quant is not None:
        steps.append(WeightFormat(config.quant, config.group_size, config.quant_head))
    if config.compile:
        steps.append(Compile())
    return steps


def decode_graphs(config: EngineConfig, device: torch.device, max_model_len: int) -> CUDAGraphs | None:
    """Chapter 15: decode steps from CUDA graphs, by default wherever there is CUDA (on the CPU
    only when asked, enforce_eager=False: the same padded path, run eagerly)."""
    eager_only = config.compile or config.speculative or config.tensor_parallel_size is not None
    if config.enforce_eager or (config.enforce_eager is None and (device.type != "cuda" or eager_only)):
        return None
    return CUDAGraphs(config.max_num_seqs, max_model_len)
# --8<-- [end:features]


DEFAULTS = EngineConfig()   # each keyword's default, read from its row of the table (minivllm/config.py)


class LLM(LLMEngine):
    """Every chapter's feature, as keywords with the server's flag names (`--kv-memory` is
    `kv_memory=`). A BaseOfflineEngine: `generate`, `generate_batch`, plus `chat`, a context
    manager, and `close()`, which stops everything it started (its loop, its worker processes).
    Each option's meaning and bounds: `EngineConfig.table()`, or any script's `--help`."""

    # --8<-- [start:init]
    def __init__(self, model: str | None = None, device: str | None = None, dtype: torch.dtype | str | None = None,
                 *, kv_memory: int | None = DEFAULTS.kv_memory, block_size: int = DEFAULTS.block_size,
                 prefix_caching: bool = DEFAULTS.prefix_caching, max_num_seqs: int = DEFAULTS.max_num_seqs,
                 max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
                 speculative: str | None = DEFAULTS.speculative,
                 num_speculative_tokens: int = DEFAULTS.num_speculative_tokens,
                 draft_model: str | None = DEFAULTS.draft_model, quant: str | None = DEFAULTS.quant,
                 group_size: int = DEFAULTS.group_size, quant_head: str = DEFAULTS.quant_head,
                 compile: bool = DEFAULTS.compile, tensor_parallel_size: int | None = DEFAULTS.tensor_parallel_size,
                 enforce_eager: bool | None = DEFAULTS.enforce_eager,
                 gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization,
                 threads: int | None = DEFAULTS.threads, structured_output: StructuredOutput | None = None):
        self.config = EngineConfig(   # every option checked, by name: nothing loaded yet
            kv_memory=kv_memory, block_size=block_size, prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens, draft_model=draft_model, quant=quant,
            group_size=group_size, quant_head=quant_head, compile=compile,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, threads=threads)
        if self.config.threads is not None:   # process-wide, as OMP_NUM_THREADS is: before any kernel runs
            torch.set_num_threads(self.config.threads)
        device = pick_device(device)
        dtype = pick_dtype(dtype, device)          # bfloat16 on a GPU, float32 elsewhere, unless asked
        self.folder = model_folder(model)
        print(f"[engine] loading {model or DEFAULT_MODEL} into LlamaModel on {device} ...", flush=True)
        tokenizer = load_tokenizer(self.folder)
        runner = self._runner(device, dtype)
        self._report(runner)
        # Chapter 15: a CUDA graph's padding rows write into the pool's last block, never handed out.
        usable = runner.kv.num_blocks - (1 if isinstance(runner, CUDAGraphRunner) else 0)
        blocks = (PrefixCachingBlockManager if self.config.prefix_caching else BlockManager)(
            usable, self.config.block_size)
        scheduler = Scheduler(blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        output = OutputProcessor(tokenizer, eos_token_ids(self.folder, tokenizer), runner.model.config.vocab_size,
                                 device, StructuredOutput() if structured_output is None else structured_output)
        if isinstance(runner, TensorParallelRunner) and runner.group:   # a dead worker fails this engine's
            runner.group.on_failure = self.fail                             # requests, then the process
        if self.config.speculative:            # Chapter 10: a runner that guesses, over the one just built
            runner = SpeculativeDecoding(self.config.speculative, self.config.num_speculative_tokens,
                                         self.config.draft_model).build(
                runner, self.folder, self.config.pool_bytes, self.config.block_size,
                [] if self.config.draft_model else [WeightFormat("int4", 32)])
        LLMEngine.__init__(self, model or DEFAULT_MODEL, tokenizer, output, runner, scheduler)
        print("[engine] ready", flush=True)

    def _runner(self, device: torch.device, dtype: torch.dtype) -> ModelRunner:
        """The weights, loaded with the steps that change them, on a KV pool: one process's runner,
        a tensor-parallel group's (Chapter 14) or one that replays CUDA graphs (Chapter 15)."""
        config, full = self.config, ModelConfig.from_folder(self.folder)
        # Chapter 15: on one GPU the pool takes what the weights leave, sized once they are in (with
        # several ranks, or a draft model's weights and pool still to come, the fixed default).
        sized_later = config.kv_memory is None and device.type == "cuda" and not config.tensor_parallel_size \
            and not config.speculative
        num_blocks = blocks_in(full, config.pool_bytes, config.block_size, dtype)   # no block: refused unloaded
        if config.tensor_parallel_size is not None:   # every rank loads its shard, then the same steps
            parallel = TensorParallel(config.tensor_parallel_size, self.folder, device)
            return parallel.start(self.folder, dtype, device, num_blocks, config.block_size, weight_steps(config))
        weights = load_model(self.folder, dtype, device, weight_steps(config))
        if sized_later:
            num_blocks = blocks_in(full, kv_memory_left(device, config.gpu_memory_utilization, step_headroom(
                full, config.max_num_batched_tokens, config.max_num_seqs, dtype)), config.block_size, dtype)
        pool = KVPool(weights.config, num_blocks, config.block_size, weights.dtype, weights.device)
        graphs = decode_graphs(config, device, weights.config.max_position_embeddings)   # Chapter 15
        return graphs.runner(weights, pool) if graphs else ModelRunner(weights, pool)
    # --8<-- [end:init]

    @property
    def speculator(self) -> Speculator | None:
        """Chapter 10's runner, where speculation is on: its guesser, its k, its counts."""
        return self.runner if isinstance(self.runner, Speculator) else None

    def _report(self, runner: ModelRunner) -> None:
        m, pool = runner.model, runner.kv
        if m.format_name:
            print(f"[engine] weights: {m.format_name}, {m.weight_bytes / 1e6:.0f} MB", flush=True)
        print(f"[engine] KV pool: {describe_pool(pool)}", flush=True)
        if self.config.compile:   # Chapter 13: the kernels are built now, not during the first request
            print("[engine] compiling the step (torch.compile) ...", flush=True)
            print(f"[engine] compiled in {runner.warm_up():.0f} s", flush=True)

    # --8<-- [start:interface]
    def new_request(self, prompt: str | list[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None, arrival: float | None = None) -> Request:
        """One place for the token budget: max_new_tokens (the book's positional argument), else
        SamplingParams.max_tokens, else DEFAULT_MAX_TOKENS; both given, the smaller."""
        if max_new_tokens is None:
            max_new_tokens = (params.max_tokens if params and params.max_tokens else None) or DEFAULT_MAX_TOKENS
        return super().new_request(prompt, max_new_tokens, params, arrival)

    def generate(self, prompt, max_new_tokens: int | SamplingParams | None = None,
                 params: SamplingParams | None = None):
        """One prompt -> a GenerateResult; a list of prompts -> a list (vLLM's `generate(prompts,
        sampling_params)` reads the same)."""
        if isinstance(max_new_tokens, SamplingParams):
            max_new_tokens, params = None, max_new_tokens
        if isinstance(prompt, (list, tuple)) and not all(isinstance(t, int) for t in prompt):
            return self.generate_batch(list(prompt), max_new_tokens, params)
        return self.submit(prompt, max_new_tokens, params).result()

    def generate_batch(self, prompts: list, max_new_tokens: int | None = None,
                       params: SamplingParams | None = None) -> list[GenerateResult]:
        return super().generate_batch(prompts, max_new_tokens, params)

    def generate_stream(self, prompt, max_new_tokens: int | None = None,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        return super().generate_stream(prompt, max_new_tokens, params)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             max_new_tokens: int | None = None):
        """A conversation (or a list of them) in the model's chat template, tokenised once, the
        text of each message read as text: a user who types "<|im_start|>" forges no turn."""
        if messages and isinstance(messages[0], (list, tuple)):
            return self.generate_batch([chat_ids(self.tokenizer, list(m)) for m in messages], max_new_tokens, params)
        return self.generate(chat_ids(self.tokenizer, list(messages)), max_new_tokens, params)

    def close(self) -> None:
        """Stop the engine loop and every process it started; what is in flight fails. Idempotent."""
        super().close()
        self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
    # --8<-- [end:interface]

    def __repr__(self) -> str:
        return f"LLM({self.model_name!r}, {self.features()})"

