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
    enable_lora, max_loras, ...     LoRA: slots beside the weights, a runner that fills them (Chapter 17)

    from minivllm import LLM, SamplingParams
    with LLM(quant="int8", prefix_caching=True) as llm:
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=16)).text)
        print(llm.chat([{"role": "user", "content": "Hi!"}]).text)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator

import torch

from minivllm.block_manager import BlockManager
from minivllm.compile import Compile
from minivllm.config import EngineConfig
from minivllm.contracts import GenerateResult, SamplingParams
from minivllm.cuda_graphs import CUDAGraphRunner, CUDAGraphs
from minivllm.engine import LLMEngine
from minivllm.engine_loop import close_at_exit
from minivllm.gpu_memory import kv_memory_left, step_headroom
from minivllm.kv_cache import KVPool, blocks_in, describe_pool
from minivllm.lora import LoRA, LoRARequest
from minivllm.many_answers import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, ManyAnswersOutput, beam_search
from minivllm.model import ModelConfig
from minivllm.model_files import (DEFAULT_MODEL, eos_token_ids, load_tokenizer, model_folder, pick_device,
                                  pick_dtype)
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import Request
from minivllm.parallel import rank_config
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


# --8<-- [start:vllm-names]
def from_vllm(options: dict, spelled: dict) -> dict:
    """LLM's options with vLLM's spellings (from the table's vllm column) put in our names' places.
    A keyword neither spells is a TypeError, as Python's own; both spellings given, too."""
    names = EngineConfig.vllm_names()
    for vllm_name, value in spelled.items():
        if vllm_name not in names:
            raise TypeError(f"LLM() got an unexpected keyword argument {vllm_name!r} (its options: "
                            f"{', '.join(EngineConfig.names())}; vLLM's spellings: {', '.join(names)})")
        ours = names[vllm_name]
        if options[ours] != getattr(DEFAULTS, ours):
            raise TypeError(f"LLM() got both {ours}= and vLLM's spelling of it, {vllm_name}=")
        options[ours] = value
    return options
# --8<-- [end:vllm-names]


def prompt_input(prompt):
    """vLLM's prompt dicts as ours: {"prompt": text} is the text, {"prompt_token_ids": ids} the ids."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) - {"multi_modal_data"} if not prompt.get("multi_modal_data") else set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        return list(ids) if isinstance(ids, (list, tuple)) else ids
    raise ValueError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (a list of ids), got {sorted(prompt)}")


def check_messages(messages) -> list[dict]:
    """A conversation: a list of dicts, each with a role and its text content (ValueError naming what lacks)."""
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r}")
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got {type(m[key]).__name__}")
    return list(messages)


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
                 enable_lora: bool = DEFAULTS.enable_lora, max_loras: int = DEFAULTS.max_loras,
                 max_lora_rank: int = DEFAULTS.max_lora_rank, max_cpu_loras: int | None = DEFAULTS.max_cpu_loras,
                 seed: int | None = DEFAULTS.seed, max_model_len: int | None = DEFAULTS.max_model_len,
                 threads: int | None = DEFAULTS.threads,
                 structured_output: StructuredOutput | None = None, **vllm_spelling):
        """Each keyword is a row of the options table; vLLM's spelling of a row is accepted too
        (enable_prefix_caching=, quantization=, kv_cache_memory_bytes=: EngineConfig.vllm_names())."""
        if structured_output is not None and not isinstance(structured_output, StructuredOutput):
            raise TypeError(f"structured_output must be a minivllm.structured.StructuredOutput or None, "
                            f"got {type(structured_output).__name__}")
        options = dict(
            kv_memory=kv_memory, block_size=block_size, prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens, draft_model=draft_model, quant=quant,
            group_size=group_size, quant_head=quant_head, compile=compile,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, enable_lora=enable_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras, seed=seed, max_model_len=max_model_len,
            threads=threads)
        self.config = EngineConfig(**from_vllm(options, vllm_spelling))   # every option checked: nothing loaded yet
        c = self.config
        self.lora = LoRA(c.max_loras, c.max_lora_rank, c.max_cpu_loras) if c.enable_lora else None   # Chapter 17
        if c.threads is not None:   # process-wide, as OMP_NUM_THREADS is: before any kernel runs
            torch.set_num_threads(c.threads)
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
        scheduler = Scheduler(blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                              self.config.max_loras if self.lora else None)
        output = ManyAnswersOutput(tokenizer, eos_token_ids(self.folder, tokenizer), runner.model.config.vocab_size,
                                 device, StructuredOutput() if structured_output is None else structured_output)
        if isinstance(runner, TensorParallelRunner) and runner.group:   # a dead worker fails this engine's
            runner.group.on_failure = self.fail                             # requests, then the process
        if self.config.speculative:            # Chapter 10: a runner that guesses, over the one just built
            runner = SpeculativeDecoding(self.config.speculative, self.config.num_speculative_tokens,
                                         self.config.draft_model).build(
                runner, self.folder, self.config.pool_bytes, self.config.block_size,
                [] if self.config.draft_model else [WeightFormat("int4", 32)])
        LLMEngine.__init__(self, model or DEFAULT_MODEL, tokenizer, output, runner, scheduler)
        if self.config.max_model_len is not None:   # vLLM's bound on prompt + output, below the model's own
            self.context_length = self.config.max_model_len
        self._seeds = itertools.count()             # LLM(seed=): request i without a seed gets one from (seed, i)
        close_at_exit(self)                         # its worker processes too, close() called or not
        print("[engine] ready", flush=True)

    def _runner(self, device: torch.device, dtype: torch.dtype) -> ModelRunner:
        """The weights, loaded with the steps that change them, on a KV pool: one process's runner,
        a tensor-parallel group's (Chapter 14) or one that replays CUDA graphs (Chapter 15)."""
        config, full = self.config, ModelConfig.from_folder(self.folder)
        if config.max_model_len is not None and config.max_model_len > full.max_position_embeddings:
            raise ValueError(f"max_model_len must be at most the model's context window, "
                             f"{full.max_position_embeddings} tokens, got {config.max_model_len}")
        # Chapter 15: on a GPU the pool takes what the weights leave, sized once they are in (with a
        # draft model's weights and pool still to come, the fixed default).
        sized_later = config.kv_memory is None and device.type == "cuda" and not config.speculative
        graphs = decode_graphs(config, device, full.max_position_embeddings)
        left = functools.partial(kv_memory_left, utilization=config.gpu_memory_utilization, headroom=step_headroom(
            full, config.max_num_batched_tokens, config.max_num_seqs, dtype, config.max_model_len, graphs is not None))
        if config.tensor_parallel_size is not None:   # every rank loads its shard, then sizes its own pool
            parallel = TensorParallel(config.tensor_parallel_size, self.folder, device)
            blocks_in(rank_config(full, parallel.size), config.pool_bytes, config.block_size, dtype)  # refused unloaded
            return parallel.start(self.folder, dtype, device, left if sized_later else config.pool_bytes,
                                  config.block_size, weight_steps(config) + ([self.lora] if self.lora else []))
        num_blocks = blocks_in(full, config.pool_bytes, config.block_size, dtype)   # no block: refused unloaded
        weights = load_model(self.folder, dtype, device, weight_steps(config) + ([self.lora] if self.lora else []))
        if sized_later:
            num_blocks = blocks_in(full, left(device), config.block_size, dtype)
        pool = KVPool(weights.config, num_blocks, config.block_size, weights.dtype, weights.device)
        if graphs:
            return self.lora.graph_runner(graphs, weights, pool) if self.lora else graphs.runner(weights, pool)
        return self.lora.runner(weights, pool) if self.lora else ModelRunner(weights, pool)
    # --8<-- [end:init]

    def capabilities(self):
        return super().capabilities().replace(serves_adapters=self.lora is not None)

    # --8<-- [start:adapters]
    # vLLM's names for the adapters an engine holds (Chapter 17): a server lists and picks them by name.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (ValueError with the reason); later requests find it loaded."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine built with enable_lora=True")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: requests already running with it finish with it."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.lora.adapters() if self.lora is not None else []
    # --8<-- [end:adapters]

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
                    params: SamplingParams | None = None, arrival: float | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """One place for the token budget: max_new_tokens (the book's positional argument), else
        SamplingParams.max_tokens, else DEFAULT_MAX_TOKENS; both given, the smaller. A
        lora_request (Chapter 17) names the adapter its rows apply; None: the base model."""
        if max_new_tokens is None:
            max_new_tokens = (params.max_tokens if params and params.max_tokens else None) or DEFAULT_MAX_TOKENS
        if self.config.seed is not None and (params is None or params.seed is None):
            seed = (self.config.seed * 0x9E3779B97F4A7C15 + next(self._seeds)) % (1 << 63)
            params = dataclasses.replace(SamplingParams.or_default(params), seed=seed)
        if lora_request is not None and self.lora is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        adapter = self.lora.add(lora_request) if lora_request is not None else None   # read once, checked
        r = super().new_request(prompt_input(prompt), max_new_tokens, params, arrival)
        if adapter is not None:         # held from when it enters the loop to when it leaves (LoRARunner)
            for m in r.group or [r]:
                m.adapter = adapter
        return r

    def generate(self, prompt, max_new_tokens: int | SamplingParams | list | None = None,
                 params: SamplingParams | list[SamplingParams] | None = None, lora_request=None, *,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None):
        """One prompt -> a GenerateResult; a list of prompts -> a list. vLLM's call reads the same:
        `generate(prompts, sampling_params)` or `generate(prompts, sampling_params=sp)`, with one
        SamplingParams or a list of them, one per prompt, and `lora_request=` (Chapter 17: one
        LoRARequest for all, or one each). A prompt is text, token ids, or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}."""
        if sampling_params is not None:
            if params is not None:
                raise TypeError("generate() got both params and sampling_params; give one")
            params = sampling_params
        if isinstance(max_new_tokens, (SamplingParams, list, tuple)):
            max_new_tokens, params = None, max_new_tokens
        if isinstance(prompt, (list, tuple)) and not all(isinstance(t, int) for t in prompt):
            return self.generate_batch(list(prompt), max_new_tokens, params, lora_request)
        if isinstance(params, (list, tuple)):
            if len(params) != 1:
                raise ValueError(f"params: {len(params)} SamplingParams for one prompt")
            params = params[0]
        if isinstance(lora_request, (list, tuple)):
            raise ValueError("one prompt takes one lora_request, not a list")
        return self.submit_all([self.new_request(prompt, max_new_tokens, params, None, lora_request)])[0].result()

    def generate_batch(self, prompts: list, max_new_tokens: int | None = None,
                       params: SamplingParams | list[SamplingParams] | None = None,
                       lora_request=None) -> list[GenerateResult]:
        adapters = {} if lora_request is None else {"lora_request": lora_request}   # Chapter 17: one, or one each
        return super().generate_batch(prompts, max_new_tokens, params, **adapters)

    def generate_stream(self, prompt, max_new_tokens: int | None = None,
                        params: SamplingParams | None = None, lora_request=None) -> Iterator[str | GenerateResult]:
        yield from self.submit_all([self.new_request(prompt, max_new_tokens, params, None, lora_request)])[0]

    def beam_search(self, prompts: list, params: BeamSearchParams, on_step=None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (Chapter 16): one BeamSearchOutput per prompt, its sequences best first.
        Each step runs every live beam as a sequence of one engine step; with prefix caching the beams
        share their common blocks, and a pruned beam's blocks go back to the pool."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]

        def step(sequences: list[list[int]], keep: int) -> list:
            results = self.generate_batch(sequences, 1, SamplingParams(max_tokens=1, logprobs=keep, ignore_eos=True))
            return [r.logprobs[0].top for r in results]
        outputs = []
        for prompt in prompts:
            ids = self.new_request(prompt, params.max_tokens).prompt_ids   # checked and tokenised as generate does
            best = beam_search(step, ids, params, self.output.eos_token_ids, on_step)   # on_step: a tracer
            outputs.append(BeamSearchOutput([BeamSearchSequence(ids + out, out, cum, score, self.tokenizer.decode(
                out, skip_special_tokens=True), finish) for score, cum, out, finish in best]))
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             max_new_tokens: int | None = None, *, sampling_params: SamplingParams | None = None):
        """A conversation (or a list of them) in the model's chat template, tokenised once, the
        text of each message read as text: a user who types "<|im_start|>" forges no turn."""
        params = sampling_params if params is None else params
        if messages and isinstance(messages[0], (list, tuple)):
            return self.generate_batch([chat_ids(self.tokenizer, check_messages(m)) for m in messages],
                                       max_new_tokens, params)
        return self.generate(chat_ids(self.tokenizer, check_messages(messages)), max_new_tokens, params)

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

