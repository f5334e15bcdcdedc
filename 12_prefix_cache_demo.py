"""12_prefix_cache_demo.py - Chapter 8's demonstration: one system prompt, many questions; one conversation.

    python 12_prefix_cache.py                     # TTFT with and without the cache, hit rate, blocks saved
    python 12_prefix_cache_demo.py --plot ch8.png      # TTFT per request, both ways, as a picture
    python 12_prefix_cache_demo.py --questions 4       # a shorter run
    python 12_prefix_cache_demo.py --at-once minivllm:LLM   # all 16 in one batch

The workload is committed in data/prefix_cache_workload.json: a help desk's system prompt
(about 400 tokens) sent with 16 different questions one after another, and a four-turn
conversation that resends its whole history every turn. Every request runs twice, back to
back, once with the cache off and once on (alternating which goes first), so both see the
same machine; greedy outputs must be identical.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

from kit import cli
from kit.engines import load_engine
from kit.workloads import REPO_ROOT
from minivllm.contracts import SamplingParams
from minivllm.kv_cache import DEFAULT_BLOCK_SIZE
from minivllm.prefix_cache import PrefixCachingBlockManager
from minivllm.text import render_chat

engine12 = importlib.import_module("12_prefix_cache_engine")


def load_workload() -> dict:
    return json.loads((REPO_ROOT / "data" / "prefix_cache_workload.json").read_text())


# --8<-- [start:pair]
def off_and_on(engine: engine12.PrefixCachingEngine, prompt: str, max_new_tokens: int, on_first: bool) -> dict:
    """The same request with the cache off and on, back to back: both results and wall times."""
    out = {}
    for caching in (True, False) if on_first else (False, True):
        engine.prefix_caching = caching
        t0 = time.perf_counter()
        result = engine.generate(prompt, max_new_tokens, SamplingParams())
        out["on" if caching else "off"] = (result, time.perf_counter() - t0)
    engine.prefix_caching = True
    (off, _), (on, _) = out["off"], out["on"]
    if on.output_ids != off.output_ids:
        raise SystemExit(f"error: the cache changed the output of {prompt[-60:]!r}")
    return {"prompt_tokens": on.metrics.input_tokens, "cached": on.metrics.cached_tokens,
            "ttft_off": off.metrics.ttft_ms, "ttft_on": on.metrics.ttft_ms,
            "s_off": out["off"][1], "s_on": out["on"][1], "text": on.text}
# --8<-- [end:pair]


def shared_system_prompt(engine, workload: dict, n: int, max_new_tokens: int) -> list[dict]:
    system = {"role": "system", "content": workload["system"]}
    print(f"\n[{n} questions, one system prompt, one after another]  block size {engine.pool.block_size}")
    print(f"  {'#':>3} {'prompt':>7} {'cached':>7}   {'TTFT off':>9} {'TTFT on':>9}   question")
    rows = []
    for i, question in enumerate(workload["questions"][:n]):
        prompt = render_chat(engine.tokenizer, [system, {"role": "user", "content": question}])
        row = off_and_on(engine, prompt, max_new_tokens, on_first=i % 2 == 1)
        rows.append(row)
        print(f"  {i + 1:>3} {row['prompt_tokens']:>7} {row['cached']:>7}   {row['ttft_off']:>6.0f} ms "
              f"{row['ttft_on']:>6.0f} ms   {question}")
    return rows


def conversation(engine, workload: dict, max_new_tokens: int) -> list[dict]:
    history = [{"role": "system", "content": workload["system"]}]
    print("\n[A conversation: every turn resends the history]")
    print(f"  {'turn':>4} {'prompt':>7} {'cached':>7}   {'TTFT off':>9} {'TTFT on':>9}   user says")
    rows = []
    for i, turn in enumerate(workload["conversation"]):
        history.append({"role": "user", "content": turn})
        row = off_and_on(engine, render_chat(engine.tokenizer, history), max_new_tokens, i % 2 == 1)
        history.append({"role": "assistant", "content": row["text"]})
        rows.append(row)
        print(f"  {i + 1:>4} {row['prompt_tokens']:>7} {row['cached']:>7}   {row['ttft_off']:>6.0f} ms "
              f"{row['ttft_on']:>6.0f} ms   {turn}")
    return rows


# --8<-- [start:at-once]
def blocks_if_concurrent(engine, workload: dict, n: int) -> tuple[int, int]:
    """Pool blocks the n question prompts would hold if all ran at once: (without, with sharing)."""
    m = PrefixCachingBlockManager(engine.pool.num_blocks, engine.pool.block_size)
    system = {"role": "system", "content": workload["system"]}
    without = 0
    for seq_id, question in enumerate(workload["questions"][:n]):
        ids = engine.tokenizer(render_chat(engine.tokenizer, [system, {"role": "user", "content": question}])
                               ).input_ids
        without += m.blocks_for(len(ids))
        m.allocate_prompt(seq_id, ids)
        m.cache_computed(seq_id, ids)      # as if its prefill had run: the next one can share it
    return without, m.num_blocks - m.num_free
# --8<-- [end:at-once]


# --8<-- [start:all-at-once]
def all_at_once(spec: str, args, workload: dict, n: int) -> None:
    """The n questions in one generate_batch call, on two engines built from `spec` with
    prefix_caching off and on. Under a scheduler (Chapter 9) a long prompt is prefilled in chunks
    over several steps, so requests admitted after the first find its published blocks."""
    engines = {on: load_engine(spec, args.model, device=args.device, block_size=args.block_size,
                               prefix_caching=on) for on in (False, True)}
    system = {"role": "system", "content": workload["system"]}
    prompts = [render_chat(engines[True].tokenizer, [system, {"role": "user", "content": q}])
               for q in workload["questions"][:n]]
    print(f"\n[{n} questions in one generate_batch call: {spec}]")
    done = {}
    for caching in (False, True):
        engine = engines[caching]
        engine.generate("Hello!", 4)          # warm-up; too short to leave a full block behind
        t0 = time.perf_counter()
        results = engine.generate_batch(prompts, args.max_new_tokens, SamplingParams())
        seconds = time.perf_counter() - t0
        done[caching] = results
        ttft = [r.metrics.ttft_ms for r in results]
        print(f"  cache {'on ' if caching else 'off'}  {seconds:6.1f} s  {n / seconds:5.2f} requests/s  "
              f"TTFT mean {sum(ttft) / n:7.0f} ms  cached tokens {[r.metrics.cached_tokens or 0 for r in results]}")
        if hasattr(engine, "close"):
            engine.close()
    same = [a.output_ids for a in done[False]] == [b.output_ids for b in done[True]]
    print(f"  outputs with the cache on and off: {'identical (greedy), every request' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit("error: the cache changed an output")
# --8<-- [end:all-at-once]


def ttft_lines(first_on_ms: float, rest_on_ms: float, rest_off_ms: float, n: int) -> list[str]:
    """Two comparisons, each with its own reference: requests 2..n against request 1 (which found
    nothing cached), and the same requests with the cache against without it."""
    if min(first_on_ms, rest_on_ms, rest_off_ms) <= 0 or n < 2:
        raise ValueError("times must be > 0 ms and there must be a request after the first")
    return [f"  TTFT, cache on: request 1 (nothing cached yet) {first_on_ms:.0f} ms; requests 2-{n} "
            f"{rest_on_ms:.0f} ms on average, {rest_on_ms / first_on_ms:.2f}x request 1's",
            f"  TTFT of requests 2-{n}: {rest_on_ms:.0f} ms with the cache, {rest_off_ms:.0f} ms without it "
            f"({rest_on_ms / rest_off_ms:.2f}x)"]


def summarize(engine, qa: list[dict], chat: list[dict], workload: dict) -> None:
    bs, n = engine.pool.block_size, len(qa)
    first, rest = qa[0], qa[1:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)   # noqa: E731
    print("\n[Summary]")
    if rest:
        print("\n".join(ttft_lines(first["ttft_on"], mean(rest, "ttft_on"), mean(rest, "ttft_off"), n)))
    for name, rows in ((f"{n} questions", qa), ("conversation", chat)):
        cached, total = sum(r["cached"] for r in rows), sum(r["prompt_tokens"] for r in rows)
        print(f"  {name}: hit rate {cached / total:.0%} of {total:,} prompt tokens; {cached // bs} blocks "
              f"({cached:,} tokens) reused instead of computed")
    s_off, s_on = sum(r["s_off"] for r in qa), sum(r["s_on"] for r in qa)
    print(f"  {n} questions, whole requests: {s_off:.1f} s off, {s_on:.1f} s on -> "
          f"{n / s_off:.2f} vs {n / s_on:.2f} requests/s ({s_off / s_on:.2f}x)")
    without, with_sharing = blocks_if_concurrent(engine, workload, n)
    print(f"  all {n} prompts in the pool at once: {without} blocks without sharing, {with_sharing} with it "
          f"({without - with_sharing} saved)")
    print("  outputs with the cache on and off: identical (greedy), every request")


def plot(qa: list[dict], chat: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    for ax, rows, label, title in ((axes[0], qa, "request", "One system prompt, different questions"),
                                   (axes[1], chat, "turn", "One conversation, turn by turn")):
        x = list(range(1, len(rows) + 1))
        ax.bar([i - 0.2 for i in x], [r["ttft_off"] for r in rows], 0.4, label="cache off", color="#9aa5b1")
        ax.bar([i + 0.2 for i in x], [r["ttft_on"] for r in rows], 0.4, label="cache on", color="#3f51b5")
        for i, r in zip(x, rows):
            ax.text(i + 0.2, r["ttft_on"], f"{r['cached']}", ha="center", va="bottom", fontsize=7)
        ax.set(xlabel=label, ylabel="TTFT (ms)", title=title, xticks=x)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle("Time to first token, cache off and on (number above a bar: prompt tokens served from the cache)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\n[Plot] saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 8: prefix caching, measured on a shared system "
                                                 "prompt and a conversation.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--questions", type=int, default=16, help="how many of the 16 questions to send")
    parser.add_argument("--max-new-tokens", type=cli.integer(1, 4096), default=24)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), help="save TTFT per request, cache off and on")
    parser.add_argument("--at-once", metavar="ENGINE", default=None,
                        help="instead: send the questions in one generate_batch call to this engine "
                             "(module:Class taking prefix_caching=), e.g. minivllm:LLM")
    args = parser.parse_args()
    workload = load_workload()
    if not 1 <= args.questions <= len(workload["questions"]):
        parser.error(f"--questions must be between 1 and {len(workload['questions'])}")
    if args.at_once and args.plot:
        parser.error("--plot draws the requests one by one, cache off and on: drop --at-once")
    try:
        if args.at_once:
            return all_at_once(args.at_once, args, workload, args.questions)
        engine = engine12.PrefixCachingEngine(args.model, device=args.device, block_size=args.block_size)
        engine.generate("Hello!", 4)            # warm-up: the first forward pays for allocations
        engine.reset_prefix_cache()
        qa = shared_system_prompt(engine, workload, args.questions, args.max_new_tokens)
        engine.reset_prefix_cache()             # the conversation starts cold too
        chat = conversation(engine, workload, args.max_new_tokens)
    except (ValueError, OSError) as exc:        # e.g. a conversation that outgrows the model's context
        raise SystemExit(f"error: {exc}") from None
    summarize(engine, qa, chat, workload)
    if args.plot:
        plot(qa, chat, args.plot)


if __name__ == "__main__":
    main()
