"""19_gpu.py - Chapter 15: on a GPU. A decode step recorded once as a CUDA graph, replayed after.

On an H200 our engine decodes at about 1 % of what its memory bandwidth allows: a decode step
is hundreds of small kernels launched one by one from Python, and host syncs between them,
while the GPU waits. Two changes, both in the package:

    minivllm/paged_attention.py  a Triton kernel: decode rows read their keys and values in
                                 place through their block tables, lengths read on the device
    minivllm/cuda_graphs.py      the decode step recorded once per batch-size bucket into static
                                 buffers, padded to its bucket and replayed with one launch

`LLM` uses graphs by default on CUDA (`enforce_eager=True`, `--enforce-eager`, turns them off);
on the CPU it decodes eagerly, and `enforce_eager=False` takes the graphs' padded path without
a graph, which is what this script shows on a machine without a GPU.

    python 19_gpu.py                     # the bucket table, one padded step's buffers, the kernel
    python 19_gpu.py --device cuda       # the same, then a decode step's time, eager vs graphs
    python 19_gpu.py --check             # what must hold before a GPU timing means anything
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from types import SimpleNamespace

import torch

from kit import cli
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.cuda_graphs import CUDAGraphRunner, bucket_for, buckets
from minivllm.kv_cache import KVPool
from minivllm.model import ModelConfig
from minivllm.model_files import pick_device, resolve_model
from minivllm.model_runner import ModelRunner, load_model
from minivllm.output import sample_on_device
from minivllm.paged_attention import paged_decode, reference_decode

engine04 = importlib.import_module("04_engine")
# Two computations of the same numbers agree to about the format's rounding: bf16 keeps 8 bits
# of mantissa (a relative step of 2**-8), fp16 11, float32 24 (a kernel sums in another order).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# --8<-- [start:static-cache]
class StaticCacheEngine(engine04.BaselineEngine):
    """Chapter 1's engine with one flag of HF's generate: cache_implementation="static". HF then
    allocates the KV cache once, at its full length, so a decode step has fixed shapes, and on
    CUDA generate compiles that step and replays it: the same two ideas as this chapter's CUDA
    graphs, for one batch at a time. It is the peer a GPU engine is measured against:
    `06_benchmark_offline.py --device cuda --engine 19_gpu:StaticCacheEngine --engine ...`."""

    def _generation_config(self, params, max_new_tokens: int):
        config = super()._generation_config(params, max_new_tokens)
        config.cache_implementation = "static"
        return config
# --8<-- [end:static-cache]


class Sequence:
    """A sequence as the runner's forward reads it: token ids, and its block table."""

    def __init__(self, ids: list[int], table: list[int]):
        self.ids, self.table = ids, table

    def tokens(self, start: int, n: int) -> list[int]:
        return self.ids[start:start + n]


# --8<-- [start:buckets]
def show_buckets(max_num_seqs: int) -> None:
    sizes = buckets(max_num_seqs)
    print(f"[buckets]  max_num_seqs={max_num_seqs}: one graph for each of {sizes}")
    for rows in (1, 3, 5, 8, 9, 17, 30):
        if rows <= max_num_seqs:
            size = bucket_for(rows, sizes)
            print(f"  {rows:>2} decode rows -> the graph of {size:>2} ({size - rows} padding rows)")
# --8<-- [end:buckets]


# --8<-- [start:padded-step]
def show_padded_step(model, prompts: list[list[int]]) -> None:
    """Prefill the prompts (eager), then one decode step through the static buffers of its bucket,
    beside the plain runner on its own pool: the same next tokens, only the scratch block differs."""
    pools = [KVPool(model.config, 16, 16, model.dtype, model.device) for _ in range(2)]
    plain = ModelRunner(model, pools[0])
    graphs = CUDAGraphRunner(model, pools[1], max_num_seqs=8, max_model_len=model.config.max_position_embeddings)
    if model.device.type == "cuda":
        graphs.capture()
    blocks = torch.randperm(graphs.scratch_block, generator=torch.Generator().manual_seed(0)).tolist()
    seqs = []
    for ids in prompts:   # enough blocks for the prompt and one more token, from a shuffled pool
        need = len(ids) // 16 + 1
        seqs.append(Sequence(list(ids), blocks[:need]))
        blocks = blocks[need:]
    tables, starts = [s.table for s in seqs], [len(s.ids) for s in seqs]
    for runner in (plain, graphs):
        first = runner.forward(seqs, [0] * len(seqs), starts, tables).argmax(-1).tolist()
    for s, token in zip(seqs, first):
        s.ids.append(token)
    expected = plain.forward(seqs, starts, [1] * len(seqs), tables)
    logits = graphs.forward(seqs, starts, [1] * len(seqs), tables)
    size, b = bucket_for(len(seqs), graphs.buckets), graphs.static
    print(f"\n[one decode step]  {len(seqs)} rows, run as the graph of {size}; scratch block {graphs.scratch_block}, "
          f"block tables {graphs.width} blocks wide (first 4 shown)")
    print(f"  {'row':>3} {'token':>6} {'position':>8} {'slot':>5} {'context':>7}  block table")
    for r in range(size):
        print(f"  {r:>3} {b.token_ids[r]:>6} {b.positions[r]:>8} {b.slots[r]:>5} {b.context_lens[r]:>7}  "
              f"{b.block_tables[r, :4].tolist()} ...{'   (padding)' if r >= len(seqs) else ''}")
    same = logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
    print(f"  next tokens {logits.argmax(-1).tolist()}: {'the same as' if same else 'NOT the same as'} the plain "
          f"runner's; max |logits difference| {float((logits - expected).abs().max()):.1e}")
    kept = graphs.scratch_block * 16    # the slots of every block but the scratch block
    untouched = all(torch.allclose(a[:kept], c[:kept], rtol=TOLERANCE[model.dtype], atol=TOLERANCE[model.dtype])
                    for a, c in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v))
    print(f"  every block but the scratch block holds what the plain runner wrote: {untouched}")
# --8<-- [end:padded-step]


# --8<-- [start:kernel-check]
def check_kernel(config, device, dtype, short: bool = False) -> float:
    """The Triton kernel against Chapter 7's gather + SDPA, on this model's heads, 8 ragged rows
    in shuffled 16-token blocks (on the CPU, Triton's interpreter runs it)."""
    # a context of 1, each side of a block boundary, long ones (short: a dry run, interpreted)
    lens = [1, 15, 16, 17, 40, 3, 31, 33] if short else [1, 15, 16, 17, 100, 257, 31, 64]
    layer = SimpleNamespace(num_layers=1, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    pool = KVPool(layer, 8 * 17, 16, dtype, device)
    torch.manual_seed(0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape))
    pool.v[0].copy_(torch.randn(pool.v[0].shape))
    tables = torch.randperm(pool.num_blocks).view(8, 17).to(device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(8, config.num_heads, config.head_dim).to(device, dtype)
    expected = reference_decode(q, pool, 0, tables, context_lens).float()
    # both passes: the whole context in one program, and split over programs in 64-token partitions
    error = max(float((paged_decode(q, pool.k[0], pool.v[0], tables, context_lens, 16, split=split,
                                    partition=64).float() - expected).abs().max()) for split in (False, True))
    print(f"\n[paged kernel]  {config.num_heads} query heads over {config.num_kv_heads} KV heads, head_dim "
          f"{config.head_dim}, {dtype}, contexts {lens}, one pass and split: max |kernel - gather + SDPA| = {error:.1e} "
          f"({'within' if error <= TOLERANCE[dtype] else 'BEYOND'} {dtype}'s tolerance {TOLERANCE[dtype]:.0e})")
    return error
# --8<-- [end:kernel-check]


# --8<-- [start:timing]
def time_decode(model, max_num_seqs: int, context: int, repeats: int) -> None:
    """A decode step's time at each bucket size, eager launches against a graph's replay, on one
    pool (both runners write the same slots: the step is repeated, not advanced)."""
    sync = torch.cuda.synchronize
    blocks_per_row = context // 16 + 1
    pool = KVPool(model.config, max_num_seqs * blocks_per_row + 1, 16, model.dtype, model.device)
    eager, graphs = ModelRunner(model, pool), CUDAGraphRunner(model, pool, max_num_seqs, context + 16)
    print(f"\n[decode step time]  {model.dtype}, {context} tokens of context a row; graphs captured in "
          f"{graphs.capture():.1f} s")
    print(f"  {'rows':>4} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}")
    for rows in [b for b in buckets(max_num_seqs) if b in (1, 2, 4, 8, 16, 32, 64)]:
        seqs = [Sequence(list(range(1, context + 2)), list(range(r * blocks_per_row, (r + 1) * blocks_per_row)))
                for r in range(rows)]
        tables = [s.table for s in seqs]
        eager.forward(seqs, [0] * rows, [context] * rows, tables)            # the context, prefilled
        times = []
        for runner in (eager, graphs):
            runner.forward(seqs, [context] * rows, [1] * rows, tables)       # warm
            sync()
            start = time.perf_counter()
            for _ in range(repeats):
                runner.forward(seqs, [context] * rows, [1] * rows, tables)
            sync()
            times.append((time.perf_counter() - start) / repeats * 1e3)
        print(f"  {rows:>4} {times[0]:>9.2f} {times[1]:>9.2f} {times[0] / times[1]:>7.1f}x")
# --8<-- [end:timing]


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# --8<-- [start:speed]
def hf_static_seconds(tokenizer, model, prompts: list[list[int]], max_new: int) -> float:
    """HF generate on one left-padded batch with a static cache (compiled and replayed on CUDA),
    warmed once at the timed lengths: seconds for the batch, every row run to max_new tokens."""
    from transformers import GenerationConfig

    device, width = model.device, max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad,
                              cache_implementation="static")
    seconds = []
    for _ in range(2):                           # the first run compiles (on CUDA) and warms: not counted
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds[-1]


def ours_seconds(llm, prompts: list[list[int]], budgets: list[int]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in budgets]
    seconds = []
    for _ in range(2):                           # warmed at the timed lengths, as HF is
        start = time.perf_counter()
        llm.generate_batch(prompts, params=params)
        seconds.append(time.perf_counter() - start)
    return seconds[-1]


def check_speed(model: str | None, device, dtype, pool: dict) -> None:
    """Output tokens/s of three workloads, ours (graphs where there is CUDA) beside HF with a static
    cache on the same device and dtype: batch 1, batch 32 (one prompt length), and mixed 32 (ragged
    prompts and outputs, so that prefill chunks share steps with decode rows). On the CPU a dry run
    on 4 rows and a few tokens: the same code, no figure worth reading."""
    cuda = device.type == "cuda"
    rows, new, prompt = (32, 128, 128) if cuda else (4, 4, 16)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, 10000, (n,), generator=g).tolist()   # noqa: E731
    lengths = torch.randint(prompt // 8, 4 * prompt, (rows,), generator=g).tolist()
    outputs = torch.randint(new // 4, new + 1, (rows,), generator=g).tolist()
    workloads = {"batch 1": ([ids(prompt)], [new]), f"batch {rows}": ([ids(prompt) for _ in range(rows)], [new] * rows),
                 f"mixed {rows}": ([ids(n) for n in lengths], outputs)}
    llm = LLM(model, device=str(device), dtype=str(dtype).removeprefix("torch."), max_num_seqs=rows,
              max_num_batched_tokens=max(512, prompt * 4), **pool)
    try:
        ours = {name: sum(b) / ours_seconds(llm, p, b) for name, (p, b) in workloads.items()}
    finally:
        llm.close()
    from minivllm.model_files import load_hf_model
    tokenizer, hf_model = load_hf_model(model, device, dtype)
    hf = {name: sum(b) / hf_static_seconds(tokenizer, hf_model, p, max(b)) for name, (p, b) in workloads.items()}
    print(f"\n[speed]  output tokens/s, {device}, {dtype}{'' if cuda else ' (a dry run: 4 rows, a few tokens)'}")
    print(f"  {'workload':<10} {'ours':>9} {'HF static':>10} {'ratio':>6}")
    for name in workloads:
        print(f"  {name:<10} {ours[name]:>9.1f} {hf[name]:>10.1f} {ours[name] / hf[name]:>5.2f}x")
# --8<-- [end:speed]


# --8<-- [start:check]
def run_checks(folder, device, model: str | None) -> bool:
    """`--check`: what must hold before any GPU timing means anything. On the CPU it is a dry
    run of the same steps (graphs take their padded path uncaptured, Triton interprets). `model`
    is the name the engines load, as given on the command line (None: the default), `folder`
    where it lies."""
    config = ModelConfig.from_folder(folder)
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    results = [(f"kernel vs gather + SDPA, {dtype}",
                check_kernel(config, device, dtype, short=device.type != "cuda") <= TOLERANCE[dtype])
               for dtype in dtypes]
    prompts = ["The capital of France is", "Once upon a time,", "1, 2, 3, 4, 5,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    # on a GPU the pool takes what gpu_memory_utilization leaves; on the CPU a small one will do
    pool = {} if device.type == "cuda" else {"kv_memory": 16 << 20}

    def tokens(**options) -> tuple[list, list]:
        llm = LLM(model, device=str(device), dtype="float32", **pool, **options)
        try:
            batch = [r.output_ids for r in llm.generate_batch(prompts, 12, greedy)]
            return batch, [llm.generate(p, 12, greedy).output_ids for p in prompts]
        finally:
            llm.close()
    eager, _ = tokens(enforce_eager=True)
    graphs, _ = tokens(enforce_eager=False)
    results.append(("greedy tokens, CUDA graphs == eager (float32)", graphs == eager))
    for quant in ("int8", "int4", "w8a8"):   # their kernels round activations to bf16, so a batch's
        batch, alone = tokens(quant=quant)    # sums may part from one row's: agreement, not identity
        agree = sum(common_prefix(a, b) for a, b in zip(batch, alone)) / sum(map(len, alone))
        results.append((f"{quant} loads; batch and one by one agree on {agree:.0%} of greedy tokens (>= 75 %)",
                        agree >= 0.75))
    if device.type == "cuda":   # the sampler never waits for the device before its one transfer
        logits = torch.randn(32, config.vocab_size, device=device)
        rows = [SimpleNamespace(params=SamplingParams(temperature=0.8, top_p=0.9), seed=i, new_ids=[], held_back=(),
                                history=None, constraint=None) for i in range(32)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            sample_on_device(logits, rows)
            results.append(("sampler with no device sync (32 sampled rows)", True))
        except RuntimeError as exc:
            results.append((f"sampler with no device sync: {exc}", False))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"\n[check]  {device}, torch {torch.__version__}")
    for name, ok in results:
        print(f"  {'ok  ' if ok else 'FAIL'}  {name}")
    if all(ok for _, ok in results):             # a timing means something only once all of it holds
        check_speed(model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, pool)
    return all(ok for _, ok in results)
# --8<-- [end:check]


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 15: CUDA graphs and a paged kernel for decode")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--max-num-seqs", type=cli.integer(1, 512), default=32, help="the largest bucket")
    parser.add_argument("--context", type=cli.integer(1, 4096), default=128, help="CUDA timing: tokens a row")
    parser.add_argument("--repeats", type=cli.integer(1, 10000), default=50, help="CUDA timing: steps timed")
    parser.add_argument("--check", action="store_true",
                        help="run the checks a first GPU run needs (kernel by dtype, graphs vs eager, weight "
                             "formats, the sampler's syncs); exit 1 if one fails. On the CPU: a dry run")
    args = parser.parse_args()
    device = pick_device(args.device)
    if device.type != "cuda":   # Triton runs its kernels on the CPU only through its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.check:
        sys.exit(0 if run_checks(resolve_model(args.model), device, args.model) else 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = resolve_model(args.model)
    model = load_model(folder, dtype, device)
    print(f"[{device}]  {model.num_parameters / 1e6:.0f}M parameters, {dtype}, torch {torch.__version__}")
    show_buckets(args.max_num_seqs)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(p).input_ids for p in ("The capital of France is", "Once upon a time, in a land far away,",
                                                "1, 2, 3, 4, 5,", "Write a haiku about the sea.", "Hello")]
    show_padded_step(model, prompts)
    check_kernel(model.config, device, dtype)
    if device.type == "cuda":
        time_decode(model, args.max_num_seqs, args.context, args.repeats)
    else:
        print("\n[decode step time]  needs CUDA: python 19_gpu.py --device cuda")


if __name__ == "__main__":
    main()
