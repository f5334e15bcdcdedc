"""16_quantization_demo.py - Chapter 12's table: what each weight format costs and buys.

For every mode: weight bytes; batch-1 decode and batch-32 tokens/s, measured in rounds that
alternate the engines, so a busy machine slows all of them alike; perplexity on a
held-out public-domain text (data/heldout_ruth_kjv.txt, never shown to the model as a
prompt anywhere else); and greedy agreement with float32 on the reference prompts.

    python 16_quantization_demo.py             # the table: long (see below)
    python 16_quantization_demo.py --plot book/assets/ch12-quantization.png
    python 16_quantization_demo.py --modes none int8 int4-g32 --rounds 1
    python 16_quantization_demo.py --replot book/outputs/16_quantization_demo.txt --plot ch12.png   # no measuring
    python 16_quantization_demo.py --device cuda   # (the default is the best device there is)

Run time: `python 16_quantization_demo.py --threads 1` took 65 minutes on a 2-core AMD EPYC
virtual machine shared with other work (load average about 14, 2026-12-04), of which 20
minutes were its own CPU time; --modes and --rounds (e.g. the third line above) cut it down.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import math
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kit import cli
from kit.quant_modes import parse_mode
from kit.workloads import REPO_ROOT, reference_prompts
from minivllm.batch import RaggedBatch
from minivllm.contracts import SamplingParams
from minivllm.model import LlamaModel
from minivllm.model_files import DEFAULT_MODEL
from minivllm.quantization import format_name_of, quantize
from minivllm.text import render_chat
from minivllm.threads import thread_count

engine04 = importlib.import_module("04_engine")        # HF's generate: the reference row
engine10 = importlib.import_module("10_model_engine")  # Chapter 6's engine, on each weight format

HELDOUT_PATH = REPO_ROOT / "data" / "heldout_ruth_kjv.txt"
LLAMA_CPP = "llama.cpp Q4_1 GGUF"
DEFAULT_MODES = ["none", "bf16", "fp16", "int8", "int8-f32head", "int4-g32", "int4-g32-int4head",
                 "int4-g64", "int4-g64-f32head"]


def variant(base: engine10.ModelEngine, spec: str) -> engine10.ModelEngine:
    """The float32 engine with its model quantised: one load, one tokenizer, many modes."""
    quant, group, head = parse_mode(spec)
    if quant == "none":
        return base                                    # Chapter 6's float32 engine itself
    engine = copy.copy(base)
    engine.runner = copy.copy(base.runner)       # the same runner, handed other weights (Chapter 12's swap)
    engine.runner.model = quantize(base.model, quant, group, head)
    return engine


# --8<-- [start:perplexity]
def heldout_ids(tokenizer) -> list[int]:
    """The held-out text's tokens; its '#' header (source and licence) is not scored."""
    lines = HELDOUT_PATH.read_text().splitlines(keepends=True)
    return tokenizer("".join(l for l in lines if not l.startswith("#")).strip()).input_ids


def perplexity(model: LlamaModel, ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of every next token, in windows of `window` tokens.

    How surprised the model is by real text: quantisation noise that matters shows up
    here as a higher number, even when greedy answers still look the same.
    """
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start: start + window + 1]
        inputs, targets = chunk[:-1], torch.tensor(chunk[1:], device=model.device)
        batch = RaggedBatch.build([inputs], [0], [0], len(inputs), model.device)
        logits = model.forward(batch, model.new_cache(1, len(inputs)), all_logits=True)
        nll += float(F.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)
# --8<-- [end:perplexity]


# --8<-- [start:agreement]
def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, int]:
    """Share of greedy tokens that equal float32's before the first divergence, and how
    many prompts agree all the way. After a divergence the texts go separate ways, and
    comparing them token by token would measure nothing."""
    matched = 0
    for ref, out in zip(reference, outputs):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        matched += same
    identical = sum(ref == out for ref, out in zip(reference, outputs))
    return matched / sum(map(len, reference)), identical


def greedy_ids(engine, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    results = engine.generate_batch(prompts, max_new_tokens, SamplingParams(ignore_eos=True))
    return [r.output_ids for r in results]
# --8<-- [end:agreement]


# --8<-- [start:speed]
def decode_rate(engine, prompt: str, max_new_tokens: int) -> float:
    """Batch-1 decode tokens/s: the pace after the first token, so the prompt's prefill (a
    compute-bound matmul, where quantised kernels gain nothing) does not blur what the weights' bytes
    buy. Our engines report it as TPOT; HF generate does not, so its prefill is timed alone and taken off."""
    params = SamplingParams(ignore_eos=True)
    t0 = time.perf_counter()
    result = engine.generate(prompt, max_new_tokens, params)
    total = time.perf_counter() - t0
    if result.metrics.tpot_ms is not None:
        return 1000 / result.metrics.tpot_ms
    t0 = time.perf_counter()
    engine.generate(prompt, 1, params)
    return (result.metrics.output_tokens - 1) / (total - (time.perf_counter() - t0))


def measure_speed(engines: dict, prompt: str, batch_prompts: list[str], max_new_tokens: int,
                  rounds: int) -> dict[str, tuple[float, float | None]]:
    """Median batch-1 decode tokens/s and batch-32 tokens/s (prefill included: all 32 requests start
    together) for every engine, the engines alternating in each round. The batch-1 rounds run
    first and on their own: each engine's turn is a second, so the host's drift hits all alike."""
    params = SamplingParams(ignore_eos=True)
    one, many = {name: [] for name in engines}, {name: [] for name in engines}
    for name, engine in engines.items():           # warm-up: first calls pay for lazy set-up
        engine.generate(prompt, 4, params)
    for _ in range(2 * rounds):
        for name, engine in engines.items():
            one[name].append(decode_rate(engine, prompt, max_new_tokens))
    batched = {name: e for name, e in engines.items() if isinstance(e, engine10.ModelEngine)}  # not HF's
    for _ in range(rounds):
        for name, engine in batched.items():
            t0 = time.perf_counter()
            n = sum(r.metrics.output_tokens for r in engine.generate_batch(batch_prompts, max_new_tokens, params))
            many[name].append(n / (time.perf_counter() - t0))
    return {name: (statistics.median(one[name]), statistics.median(many[name]) if many[name] else None)
            for name in engines}
# --8<-- [end:speed]


def rounds_phrase(n: int) -> str:
    """What a speed column summarises, said truly for any count: one round has no median,
    and the median of two is their mean. The engines take turns within each round."""
    if n < 1:
        raise ValueError(f"at least one round, got {n}")
    if n == 1:
        return "one round"
    return f"{'the mean' if n == 2 else 'the median'} of {n} rounds, engines alternating"


def print_table(rows: list[dict]) -> None:
    first = rows[0]
    print(f"\n  {'mode':<22}{'weights':>9}{'batch-1 decode':>20}{'batch-32 tok/s':>21}"
          f"{'perplexity':>18}{'same tokens':>13}{'same answers':>14}")
    for r in rows:
        b1 = f"{r['b1']:.1f} ({r['b1'] / first['b1']:.2f}x)"
        b32 = f"{r['b32']:.0f} ({r['b32'] / first['b32']:.2f}x)" if r.get("b32") else "-"
        ppl = f"{r['ppl']:.3f} ({100 * (r['ppl'] / first['ppl'] - 1):+.1f}%)" if r.get("ppl") else "-"
        # Two measures, two columns: the share of tokens equal to float32's up to the first divergence,
        # and how many answers are equal all the way (4/7 next to 83% is no contradiction).
        tokens = f"{100 * r['agree']:.0f}%" if r.get("agree") is not None else "-"
        answers = f"{r['identical']} of {r['prompts']}" if r.get("agree") is not None else "-"
        print(f"  {r['name']:<22}{r['mb']:>6.0f} MB{b1:>20}{b32:>21}{ppl:>18}{tokens:>13}{answers:>14}")


# One row of print_table: name, weights, batch-1 (ratio), batch-32 (ratio) or -, perplexity (change) or -.
TABLE_ROW = re.compile(r"^  (?P<name>\S.*?)\s+(?P<mb>\d+) MB\s+(?P<b1>[\d.]+) \([\d.]+x\)"
                       r"\s+(?:(?P<b32>\d+) \([\d.]+x\)|-)\s+(?:(?P<ppl>[\d.]+) \([^)]*\)|-)", re.M)


def rows_from_table(text: str) -> list[dict]:
    """The rows of a saved run's printed table (a capture of this script), enough to redraw the plot."""
    rows = [{"name": m["name"], "mb": float(m["mb"]), "b1": float(m["b1"]),
             "b32": float(m["b32"]) if m["b32"] else None, "ppl": float(m["ppl"]) if m["ppl"] else None}
            for m in TABLE_ROW.finditer(text)]
    if not rows:
        raise ValueError("no table rows found: expected the output of 16_quantization_demo.py")
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Two panels with their own speed axes: batch-1 decode and batch-32 throughput differ by
    several times, and each is worth reading on its own scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ppl")]
    panels = (("b1", "o", "batch 1: decode tokens/s (after the first token)"),
              ("b32", "s", "batch 32: output tokens/s (prefill included)"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, (key, marker, xlabel) in zip(axes, panels):
        points = [r for r in rows if r.get(key)]
        ax.scatter([r[key] for r in points], [r["ppl"] for r in points], marker=marker)
        for i, r in enumerate(points):   # neighbours get labels above and below
            ax.annotate(r["name"], (r[key], r["ppl"]), textcoords="offset points", fontsize=8,
                        xytext=(5, 5 if i % 2 else -11))
        ax.set_xlabel(f"{xlabel}, higher is better")
        ax.margins(x=0.15)   # room for the labels of the outermost points
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("perplexity on held-out text (lower is better)")
    fig.suptitle("Chapter 12: speed against quality, one point per weight format")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\n[plot] {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 12: weight formats measured side by side.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES,
                        help="none, bf16, fp16, int8, int4-g32, ...; '-f32head' keeps the head in float32, "
                             "'-int4head' packs it in int4 too")
    parser.add_argument("--max-new-tokens", type=cli.integer(2, 4096), default=32,
                        help="at least 2: decode speed is timed from the second token on")
    parser.add_argument("--rounds", type=cli.integer(1, 100), default=3,
                        help="alternating batch-32 rounds, twice as many at batch 1 (medians are shown)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate batch-1 anchor")
    parser.add_argument("--llama-cpp", default=None, metavar="GGUF",
                        help="also time llama.cpp on this GGUF at batch 1 (needs llama-cpp-python; "
                             "see 16_llama_cpp.py)")
    parser.add_argument("--plot", default=None, metavar="PNG", type=cli.plot_file(), help="speed against perplexity")
    parser.add_argument("--replot", default=None, metavar="TABLE",
                        help="with --plot: redraw the plot from a saved run's output, without measuring")
    args = parser.parse_args()
    if args.llama_cpp == "":
        parser.error("--llama-cpp needs the path of a GGUF file")
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot PNG")
        try:
            plot(rows_from_table(open(args.replot, encoding="utf-8").read()), args.plot)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
        return
    try:
        specs = list(args.modes)
        for spec in specs:
            parse_mode(spec)
        if specs[0] != "none":
            specs.insert(0, "none")                # float32 is what every ratio is against
        base = engine10.ModelEngine(args.model, device=args.device)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    engines = {}
    for spec in specs:
        engines[format_name_of(*parse_mode(spec))] = variant(base, spec)
    hf = None if args.no_hf else engine04.BaselineEngine(args.model, device=args.device)
    tok = base.tokenizer
    anchors = {"HF generate (float32)": hf} if hf else {}
    if args.llama_cpp:
        try:
            anchors[LLAMA_CPP] = importlib.import_module("16_llama_cpp").LlamaCppEngine(
                args.llama_cpp, tok, torch.get_num_threads())
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    prompt = render_chat(tok, [{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    refs = reference_prompts()
    batch_prompts = (refs * 5)[:32]
    print("[speed] alternating rounds ...", file=sys.stderr, flush=True)
    speed = measure_speed({**engines, **anchors}, prompt, batch_prompts, args.max_new_tokens, args.rounds)

    ids, rows = heldout_ids(tok), []
    reference = greedy_ids(base, refs, args.max_new_tokens)
    for name, engine in engines.items():
        print(f"[quality] {name}", file=sys.stderr, flush=True)
        share, identical = agreement(reference, greedy_ids(engine, refs, args.max_new_tokens))
        rows.append({"name": name, "mb": engine.model.weight_bytes / 1e6, "b1": speed[name][0],
                     "b32": speed[name][1], "ppl": perplexity(engine.model, ids), "agree": share,
                     "identical": identical, "prompts": len(refs)})
    if hf:
        mb = sum(p.numel() * p.element_size() for p in hf.model.parameters()) / 1e6
        rows.append({"name": "HF generate (float32)", "mb": mb, "b1": speed["HF generate (float32)"][0]})
    if LLAMA_CPP in anchors:
        rows.append({"name": LLAMA_CPP, "mb": anchors[LLAMA_CPP].file_bytes / 1e6, "b1": speed[LLAMA_CPP][0]})
    where = thread_count() if base.device.type == "cpu" else str(base.device)
    print(f"\n[Chapter 12] {DEFAULT_MODEL if args.model is None else args.model} on "
          f"{where}; perplexity over {len(ids)} held-out tokens; same tokens (before the first difference) "
          f"and same answers over {len(refs)} reference prompts x {args.max_new_tokens} greedy tokens; speed: "
          f"batch 1 {rounds_phrase(2 * args.rounds)}, batch 32 {rounds_phrase(args.rounds)}, "
          f"{args.max_new_tokens} new tokens, ratios to float32")
    print_table(rows)
    decode = {r["name"]: r["b1"] for r in rows}
    best = max((n for n in decode if n.startswith("int4")), key=decode.get, default=None)
    for anchor in anchors if best else ():
        print(f"\n  batch-1 decode: {best} runs at {decode[best] / decode[anchor]:.2f}x the speed of {anchor}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
