"""14_speculative_decoding_demo.py - Chapter 10, measured: guesses step by step, then the table.

    python 14_speculative_decoding_demo.py                       # trace, then the k sweep at batch 1
    python 14_speculative_decoding_demo.py --ks 1 4 8 --plot spec.png
    python 14_speculative_decoding_demo.py --concurrent 32       # ... and 32 mixed requests at once

1. One request's verifications, one line each: the guesses the model kept (green), the
   token it put in place of the first wrong guess (yellow), the guesses thrown away (red).
2. For both drafters on both workloads (data/speculative_input_grounded.json: answers that
   copy or edit their input; data/speculative_open_chat.json: they do not), against k: how
   many guesses were kept, tokens per forward of the model, and the speed-up over the same
   engine without speculation, every pair of runs alternating on the same prompts. Beside
   them, in the same run, HF's own: generate(prompt_lookup_num_tokens=k) and
   generate(assistant_model=...) (this model in bfloat16 as the assistant), each against plain
   generate. Greedy throughout, so every engine's tokens must be identical: this is checked.
3. With --concurrent N: N requests of the mixed workload at once through the continuous-batching
   engine, with and without speculation: a busy engine guesses less (SPECULATION_TOKEN_BUDGET).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kit import cli, workloads
from minivllm import LLM, threads
from minivllm.config import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS
from minivllm.model_files import load_hf_model, resolve_model
from minivllm.text import render_chat

WORKLOADS = {"input-grounded": "data/speculative_input_grounded.json", "open chat": "data/speculative_open_chat.json"}
TRACE_PROMPT = 0   # the one whose answer copies most of its input
GREEN, YELLOW, RED, PLAIN = "\033[32m", "\033[33m", "\033[31;9m", "\033[0m"


# --8<-- [start:trace]
class Tracer:
    """Wraps an engine's speculating runner and remembers, per verification, the guesses and what was kept."""

    def __init__(self, speculator):
        self.inner, self.steps = speculator, []

    def __getattr__(self, name):   # everything else is the wrapped runner's
        return getattr(self.inner, name)

    def run(self, requests, starts, lengths, places):
        guesses = [list(r.draft_ids) for r in requests]
        runs = self.inner.run(requests, starts, lengths, places)
        self.steps += [(g, run) for g, run in zip(guesses, runs) if run is not None]
        return runs


def show_trace(engine, prompt: str, tokenizer, new_tokens: int) -> None:
    """Each verification on one line: the guesses kept, the model's own token, the guesses thrown away."""
    tracer = engine.runner = Tracer(engine.runner)
    try:
        result = engine.generate(prompt, new_tokens)
    finally:
        engine.runner = tracer.inner
    tty = sys.stdout.isatty()
    paint = lambda colour, ids: (colour if tty else "") + json.dumps(tokenizer.decode(ids)) + (PLAIN if tty else "")  # noqa: E731
    print(f"  {'step':>4}  {'kept':>5}  text: kept guesses + the model's own token, then rejected guesses")
    produced = 0
    for i, (guesses, full) in enumerate(tracer.steps):
        run = full[:len(result.output_ids) - produced]  # a stop or EOS may end the request inside a run
        produced += len(run)
        ended = len(run) < len(full)
        ok = 0                                          # the guesses kept and emitted: those the run starts with
        while ok < min(len(run), len(guesses)) and run[ok] == guesses[ok]:
            ok += 1
        line = f"  {i:>4}  {ok:>2}/{len(guesses):<2}  {paint(GREEN, run[:ok])} + {paint(YELLOW, run[ok:])}"
        print(line + ("   (the request ends here)" if ended else
                      f"   rejected {paint(RED, guesses[ok:])}" if ok < len(guesses) else ""))
    m = result.metrics
    print(f"  {m.output_tokens} tokens in {len(tracer.steps)} forwards of the model; "
          f"{m.accepted_tokens or 0} of {m.draft_tokens or 0} guesses kept")
# --8<-- [end:trace]


def print_costs(columns: dict[str, dict[int, float]]) -> None:
    """One line per number of tokens fed: each column's milliseconds, and in decode steps."""
    print((f"  {'':<39}" + "".join(f"{name:<34}" for name in columns)).rstrip())
    for n in next(iter(columns.values())):
        print((f"  feed {n} token(s) ({n - 1} guesses checked):" + "".join(
            f"{cost[n]:8.1f} ms = {cost[n] / cost[1]:4.2f} decode steps   " for cost in columns.values())).rstrip())


# --8<-- [start:cost]
def verification_cost(engine, sizes=(1, 2, 3, 5, 9), context: int = 400, rounds: int = 7,
                      weights: dict | None = None) -> dict[int, float]:
    """Milliseconds of one forward of the model feeding n tokens of one sequence after `context`
    cached ones (median of rounds): what checking n - 1 guesses costs against a plain decode step.
    weights: the same model's weights in another layout (Chapter 13's packed ones), for this timing only."""
    ids = list(range(1000, 1000 + context + max(sizes)))
    blocks, seq = engine.blocks, -1                      # a sequence of our own, given back after
    blocks.allocate(seq, len(ids))
    own = engine.runner.model.w
    engine.runner.model.w = own if weights is None else weights
    try:
        runner, table = engine.runner, blocks.tables[seq]
        batch = lambda start, n: engine.pool.batch([ids[start:start + n]], [table], [start], engine.device)  # noqa: E731
        runner.model.forward(batch(0, context), runner.kv)            # the context's K/V, once
        out = {}
        for n in sizes:
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                runner.model.forward(batch(context, n), runner.kv, num_logits=[n])
                times.append(time.perf_counter() - t)
            out[n] = sorted(times)[rounds // 2] * 1e3
        return out
    finally:
        engine.runner.model.w = own
        blocks.free(seq)
# --8<-- [end:cost]


# --8<-- [start:sweep]
def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def sweep(plain, engines: dict, prompts: list[str], ks: list[int], new_tokens: int) -> list[dict]:
    """Per drafter and k: acceptance, tokens per forward, speed-up; plain and speculative alternate."""
    rows = []
    for method, engine in engines.items():
        for k in ks:
            engine.speculator.k = k
            t_plain = t_spec = drafted = kept = tokens = forwards = 0
            for prompt in prompts:
                a, ta = timed(plain.generate, prompt, new_tokens)
                steps = engine.num_steps
                b, tb = timed(engine.generate, prompt, new_tokens)
                forwards += engine.num_steps - steps        # batch 1: a step is one forward of the model
                if a.output_ids != b.output_ids:
                    raise AssertionError(f"{method} k={k} changed the output of {prompt[:40]!r}")
                t_plain, t_spec = t_plain + ta, t_spec + tb
                drafted, kept = drafted + (b.metrics.draft_tokens or 0), kept + (b.metrics.accepted_tokens or 0)
                tokens += len(b.output_ids)
            rows.append({"method": method, "k": k, "acceptance": kept / max(drafted, 1),
                         "tokens_per_forward": tokens / forwards, "speedup": t_plain / t_spec})
    return rows


def hf_reference(model_name: str | None, prompts: list[str], ks: list[int], new_tokens: int) -> list[dict]:
    """HF's assisted generation against plain generate, on the same prompts, alternating."""
    tokenizer, model = load_hf_model(model_name, "cpu")
    assistant = None
    rows = []
    for how in ("prompt lookup", "assistant bf16"):
        for k in ks:
            extra = {"prompt_lookup_num_tokens": k}
            if how == "assistant bf16":
                if assistant is None:
                    assistant = type(model).from_pretrained(resolve_model(model_name), dtype=torch.bfloat16).eval()
                assistant.generation_config.num_assistant_tokens = k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
                extra = {"assistant_model": assistant}
            t_plain = t_assist = 0.0
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt")
                run = dict(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
                with torch.inference_mode():
                    a, ta = timed(model.generate, **run)
                    b, tb = timed(model.generate, **run, **extra)
                t_plain, t_assist = t_plain + ta, t_assist + tb
            rows.append({"method": f"HF {how}", "k": k, "speedup": t_plain / t_assist})
    return rows
# --8<-- [end:sweep]


def concurrent(plain, engines: dict, n: int) -> None:
    """n mixed requests at once, each with its own budget; output tokens/s with and without
    speculation, alternating, the same greedy tokens checked."""
    items = workloads.mixed_workload(plain.tokenizer, n)

    def run(engine):
        t0 = time.perf_counter()
        streams = engine.submit_all([engine.new_request(w.prompt, w.max_new_tokens, arrival=t0) for w in items])
        results = [s.result() for s in streams]
        return results, sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0)

    print(f"\n[{n} requests of the mixed workload at once, continuous batching: output tokens/s]")
    for method, engine in engines.items():
        (a, rate_a), (b, rate_b) = run(plain), run(engine)
        same = all(x.output_ids == y.output_ids for x, y in zip(a, b))
        kept, drafted = sum(r.metrics.accepted_tokens or 0 for r in b), sum(r.metrics.draft_tokens or 0 for r in b)
        print(f"  {method:<6} without {rate_a:6.1f}   with {rate_b:6.1f}   ratio {rate_b / rate_a:.2f}   "
              f"guesses kept {kept}/{drafted}   same tokens: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 10 measured: speculative decoding step by step and against k.")
    cli.add_model_flags(parser, device=False)
    parser.add_argument("--part", choices=("all", "trace", "sweep"), default="all",
                        help="trace: one request's verifications and their cost; sweep: the table against k")
    parser.add_argument("--trace-prompt", type=cli.integer(0, 7), default=TRACE_PROMPT,
                        help="which input-grounded prompt the trace follows")
    parser.add_argument("--ks", type=cli.integer(1, MAX_SPECULATIVE_TOKENS), nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=cli.integer(1, 8), default=4, help="prompts of each workload")
    parser.add_argument("--max-new-tokens", type=cli.integer(1, 1024), default=96)
    parser.add_argument("--concurrent", type=cli.integer(0, 256), default=0, metavar="N",
                        help="also run N mixed-workload requests at once")
    parser.add_argument("--no-hf", action="store_true", help="skip HF's assisted generation")
    parser.add_argument("--plot", type=cli.plot_file(), default=None, help="draw speed-up and acceptance against k")
    args = parser.parse_args()
    cpu = threads.cpu_name()
    # The CPU's story (Chapter 4's ridge point): every engine here, and HF's, runs on the CPU.
    plain = LLM(args.model, device="cpu")
    engines = {m: LLM(args.model, device="cpu", speculative=m) for m in SPECULATIVE_METHODS}
    if args.part in ("all", "trace"):
        chat = workloads.load_prompts(WORKLOADS["input-grounded"])[args.trace_prompt]["messages"]
        for method, title in (("ngram", "prompt lookup"), ("draft", "the int4 self-draft")):
            print(f"\n[One request, {title}, k={engines[method].speculator.k}: {chat[0]['content'][:50]!r}...]")
            show_trace(engines[method], render_chat(plain.tokenizer, chat), plain.tokenizer, 64)
        print(f"\n[What a verification costs: one forward of the model, one sequence, 400 tokens cached; {cpu}]")
        print_costs({"float32 weights as loaded": verification_cost(plain)})
    if args.part in ("all", "sweep"):
        results = table(plain, engines, args, cpu)
        if args.concurrent:
            concurrent(plain, engines, args.concurrent)
        if args.plot:
            plot(results, args.plot)
            print(f"\n[plot] {args.plot}")
    for e in [plain, *engines.values()]:
        e.close()


def table(plain, engines: dict, args, cpu: str) -> dict:
    """The sweep on both workloads (and HF's beside it), printed as one table."""
    results = {}
    for name, path in WORKLOADS.items():
        prompts = [render_chat(plain.tokenizer, p["messages"]) for p in workloads.load_prompts(path, args.prompts)]
        results[name] = sweep(plain, engines, prompts, args.ks, args.max_new_tokens)
        if not args.no_hf:
            results[name] += hf_reference(args.model, prompts, args.ks, args.max_new_tokens)
    print(f"\n[batch 1, greedy, {args.prompts} prompts x {args.max_new_tokens} new tokens each, "
          f"speed-up over the same engine without speculation (HF: over plain generate); {cpu}]")
    print(f"  {'workload':<15} {'drafter':<20} {'k':>2}  {'kept':>5}  {'tokens/forward':>14}  {'speed-up':>8}")
    for name, rows in results.items():
        for row in rows:
            kept = f"{row['acceptance']:5.0%}" if "acceptance" in row else "    -"
            per = f"{row['tokens_per_forward']:14.2f}" if "tokens_per_forward" in row else f"{'-':>14}"
            print(f"  {name:<15} {row['method']:<20} {row['k']:>2}  {kept}  {per}  {row['speedup']:7.2f}x")
    return results


def plot(results: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            style = "--" if method.startswith("HF") else "-"
            axes[0].plot([r["k"] for r in mine], [r["speedup"] for r in mine], style, marker="o", label=f"{name}, {method}")
            if "acceptance" in mine[0]:
                axes[1].plot([r["k"] for r in mine], [r["acceptance"] for r in mine], marker="o", label=f"{name}, {method}")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(xlabel="guesses per verification (k)", ylabel="speed-up over no speculation", title="Speed-up, batch 1")
    axes[1].set(xlabel="guesses per verification (k)", ylabel="share of guesses kept", title="Acceptance", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
