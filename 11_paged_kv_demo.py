"""11_paged_kv_demo.py - Chapter 7's demonstration: what pages save, and block tables live.

    python 11_paged_kv.py                          # the numbers
    python 11_paged_kv_demo.py --plot ch7-paged.png     # and the picture
    python 11_paged_kv_demo.py --kv-memory 64MB --block-size 16

Three ways to hold the KV cache of the committed mixed workload (data/mixed_workload.json),
for a fixed memory budget:

    max-length regions   every sequence reserves the longest sequence the server accepts
                         (Chapter 6's contiguous layout, sized for the worst case)
    per-request regions  every sequence reserves its own prompt + max_tokens
    pages                every sequence holds ceil(tokens it really has / block_size) blocks

The pages row counts each sequence at the length its answer really reached. An engine gets
there only by growing sequences on demand and preempting when the pool runs dry (Chapter 9);
Chapter 7's PagedEngine reserves prompt + max_tokens at admission, like the per-request row,
and runs at most max_num_seqs (32) sequences at once.
"""

from __future__ import annotations

import functools
import importlib
import itertools

import torch

from kit import cli
from kit.demo import demo, demo_parser
from kit.workloads import load_workload, reference_prompts
from minivllm.contracts import SamplingParams
from minivllm.kv_cache import DEFAULT_BLOCK_SIZE

engine11 = importlib.import_module("11_paged_kv_engine")


# --8<-- [start:capacity]
def slots_per_request(workload: dict, block_size: int) -> dict[str, list[int]]:
    """KV slots each request of the workload ties up, three ways, when it is at its longest."""
    reqs = workload["requests"]
    max_len = workload["max_prompt_tokens"] + max(workload["max_tokens_choices"])
    tokens = [r["prompt_tokens"] + r["output_tokens"] for r in reqs]     # what each really holds
    return {
        "max-length regions": [max_len] * len(reqs),
        "per-request regions": [r["prompt_tokens"] + r["max_tokens"] for r in reqs],
        f"pages of {block_size}": [-(-t // block_size) * block_size for t in tokens],
    }


def capacity(workload: dict, kv_memory: int, bytes_per_token: int, block_size: int) -> dict:
    """How many of the workload's sequences (at their full length) fit in kv_memory, three ways."""
    tokens = [r["prompt_tokens"] + r["output_tokens"] for r in workload["requests"]]
    budget_tokens = kv_memory // bytes_per_token
    out = {}
    for name, slots in slots_per_request(workload, block_size).items():
        fits, used = 0, 0
        for s in itertools.cycle(slots):     # requests keep arriving in workload order
            if used + s > budget_tokens:
                break
            fits, used = fits + 1, used + s
        out[name] = {"fits": fits, "slots_per_seq": sum(slots) / len(slots),
                     "waste": 1 - sum(tokens) / sum(slots)}
    return out
# --8<-- [end:capacity]


def capacity_header(kv_memory: int, bytes_per_token: int, num_blocks: int, block_size: int) -> str:
    """The budget in tokens, said both ways: contiguous regions can use every slot the bytes
    buy, while the paged pool holds only whole blocks (the number the engine prints at start)."""
    return (f"[Capacity]  {kv_memory / 2**20:.0f} MiB of KV cache at {bytes_per_token:,} bytes/token: "
            f"{kv_memory // bytes_per_token:,} token slots as regions, {num_blocks * block_size:,} in the pool's "
            f"{num_blocks:,} whole blocks of {block_size}; mixed workload of data/mixed_workload.json")


def print_capacity(table: dict, header: str) -> None:
    print(f"\n{header}")
    print(f"  {'layout':<22}{'slots/sequence':>15}{'wasted':>9}{'sequences that fit':>21}")
    base = next(iter(table.values()))["fits"]
    for name, row in table.items():
        print(f"  {name:<22}{row['slots_per_seq']:>15.0f}{row['waste']:>9.0%}{row['fits']:>14}  "
              + (f"({row['fits'] / base:.1f}x)" if base else "(-)"))


# --8<-- [start:live]
def live_block_tables(engine, prompts: list[str], steps: int, params: SamplingParams) -> list[tuple]:
    """Run a batch for `steps` decode steps and return every sequence's (tokens, block table)."""
    budget = params.token_budget(64)
    loop = engine.run([engine.new_request(p, budget, params) for p in prompts])
    try:
        for _, _ in zip(range(steps + 1), loop):
            pass
        return [(engine.blocks.lengths[i], list(engine.blocks.tables[i]))
                for i in sorted(engine.blocks.tables)]
    finally:
        loop.close()         # frees every block (the finally in run)
# --8<-- [end:live]


def plot(table: dict, workload: dict, bytes_per_token: int, block_size: int,
         live: list[tuple], num_blocks: int, kv_memory: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    reqs = workload["requests"]
    per_seq = {**slots_per_request(workload, block_size),
               "tokens actually held": [r["prompt_tokens"] + r["output_tokens"] for r in reqs]}
    n = list(range(1, max(row["fits"] for row in table.values()) * 5 // 4 + 1))   # past the last that fits
    for name, slots in per_seq.items():
        used = list(itertools.accumulate(slots[(k - 1) % len(slots)] * bytes_per_token / 2**20 for k in n))
        fits = table[name]["fits"] if name in table else None
        line, = left.plot(n, used, label=f"{name}: {fits} fit" if fits else name,
                          linestyle=":" if fits is None else "-")
        if fits:                     # the last request that still fits in the pool
            left.plot(fits, used[fits - 1], "o", color=line.get_color())
    left.axhline(kv_memory / 2**20, color="grey", linestyle="--", label=f"pool: {kv_memory / 2**20:.0f} MiB")
    left.set_ylim(0, kv_memory / 2**20 * 1.6)
    left.set(xlabel="concurrent requests", ylabel="KV cache reserved (MiB)",
             title="Memory for the mixed workload")
    left.legend()
    left.grid(alpha=0.3)
    # The first blocks of the pool as a grid, each coloured by the sequence whose table holds it.
    cols = 8
    shown = -(-(max(max(t) for _, t in live) + 1) // cols) * cols
    owner = torch.full((shown,), float("nan"))
    for s, (_, table_) in enumerate(live):
        owner[table_] = s
    right.imshow(owner.view(-1, cols), cmap="tab10", vmin=0, vmax=9)
    for b in range(shown):
        label = f"{b}" if owner[b].isnan() else f"{b}\nseq {int(owner[b])}"
        right.text(b % cols, b // cols, label, ha="center", va="center", fontsize=7)
    for s, (tokens, table_) in enumerate(live):
        right.plot([], [], "s", color=plt.cm.tab10(s / 9), label=f"seq {s}: {tokens} tokens -> table {table_}")
    right.set(title=f"Pool blocks 0-{shown - 1} (of {num_blocks}); blank = free", xticks=[], yticks=[])
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=7, ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\n[Plot] saved {path}")


def main() -> None:
    parser = demo_parser("Chapter 7: a paged KV cache.")
    parser.add_argument("--kv-memory", default="512MB", help="KV pool size (default 512MB; MB means MiB, 2**20 bytes)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(),
                        help="save memory-vs-requests and block-table pictures")
    args = parser.parse_args()
    try:
        kv_memory = cli.parse_bytes(args.kv_memory)
    except ValueError as exc:
        parser.error(str(exc))
    engine_class = functools.partial(engine11.PagedEngine, kv_memory=kv_memory, block_size=args.block_size)
    engine, _, _ = demo(engine_class, args)
    per_token = engine.model.config.kv_bytes_per_token(engine.model.dtype)
    workload = load_workload()
    table = capacity(workload, kv_memory, per_token, args.block_size)
    print_capacity(table, capacity_header(kv_memory, per_token, engine.blocks.num_blocks, args.block_size))

    prompts = reference_prompts()[:4]
    live = live_block_tables(engine, prompts, steps=20, params=SamplingParams(ignore_eos=True))
    print(f"\n[Block tables after prefill + 20 decode steps]  pool of {engine.blocks.num_blocks} blocks "
          f"x {args.block_size} tokens")
    for s, (tokens, table_) in enumerate(live):
        print(f"  seq {s}: {tokens:4d} tokens -> {len(table_)} blocks {table_}")
    print(f"  after the batch: {engine.blocks.num_free} of {engine.blocks.num_blocks} blocks free")
    if args.plot:
        plot(table, workload, per_token, args.block_size, live, engine.blocks.num_blocks, kv_memory, args.plot)


if __name__ == "__main__":
    main()
