"""15_structured_output_demo.py - Chapter 11 measured: how often free text is valid JSON, and what the mask costs.

For each task of data/structured_output.json (a request for JSON in words, and the schema
the answer must match) the model answers free and constrained, greedy and with seeded
sampling; each answer either parses and validates against its schema or not. Then the same
requests run unconstrained and constrained on the continuous-batching engine, at batch 1 and
at batch 32, alternating (A, B, B, A) so that a busy machine slows both alike; the compile
time of each schema is reported apart (it is paid once, then cached).

    python 15_structured_output_demo.py
    python 15_structured_output_demo.py --plot ch11-structured.png
    python 15_structured_output_demo.py --small          # a quick look: fewer samples, no batch 32
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jsonschema

from kit import cli, progress
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.structured import compile_spec, compiler_for, make_constraint
from minivllm.text import render_chat

TASKS = Path(__file__).resolve().parent / "data" / "structured_output.json"
BUDGET = 160


def load_tasks() -> list[dict]:
    return json.loads(TASKS.read_text())["tasks"]


# --8<-- [start:verdict]
def verdict(text: str, schema: dict) -> str:
    """'valid', 'parses' (JSON, but not the schema's) or 'broken'. Lenient with free text: the JSON
    may also be inside a ```json fence, or between the first '{' and the last '}'."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    for body in (text, fenced and fenced.group(1), text[text.find("{"): text.rfind("}") + 1]):
        try:
            value = json.loads(body)
            break
        except (TypeError, ValueError):
            continue
    else:
        return "broken"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return "parses"
    return "valid"
# --8<-- [end:verdict]


def run_all(engine, prompts: list[str], params: list[SamplingParams]) -> tuple[list, float]:
    """Every request in the engine at once (they share its steps); results and the wall time."""
    t0 = time.perf_counter()
    streams = engine.submit_all([engine.new_request(p, BUDGET, sp, arrival=t0) for p, sp in zip(prompts, params)])
    results = [s.result() for s in streams]
    return results, time.perf_counter() - t0


def validity(engine, tasks: list[dict], prompts: list[str], seeds: int, bar=None) -> dict:
    """Counts of valid / parses / broken answers, free and constrained, over greedy + seeded samples.
    `bar` (kit.progress) hears of every pass over the tasks."""
    counts = {mode: {"valid": 0, "parses": 0, "broken": 0} for mode in ("free", "constrained")}
    examples = {}
    for mode in counts:
        for seed in [None, *range(seeds)]:
            sampling = {} if seed is None else {"temperature": 0.7, "seed": seed}
            params = [SamplingParams(**sampling, **({"structured": {"json_schema": t["schema"]}}
                                                    if mode == "constrained" else {})) for t in tasks]
            results, _ = run_all(engine, prompts, params)
            if bar:
                bar.update(1, note=f"validity, {mode}, {'greedy' if seed is None else f'seed {seed}'}")
            for task, result in zip(tasks, results):
                counts[mode][verdict(result.text, task["schema"])] += 1
                if seed is None:
                    examples.setdefault(task["name"], {})[mode] = result
    return {"counts": counts, "examples": examples}


# --8<-- [start:mask-cost]
def mask_cost(engine, spec: tuple, output_ids: list[int]) -> list[float]:
    """Microseconds to mask one row at each step of an answer, replaying its tokens."""
    import torch

    out = engine.output
    constraint = make_constraint(engine.tokenizer, out.vocab_size, out.eos_token_ids, spec)
    row, times = torch.zeros(out.vocab_size), []
    for token in output_ids:
        t0 = time.perf_counter()
        constraint.mask(row)
        times.append((time.perf_counter() - t0) * 1e6)
        constraint.accept(token)
    return times
# --8<-- [end:mask-cost]


def speed(engine, tasks: list[dict], prompts: list[str], lengths: list[int], batch: int, rounds: int,
          bar=None) -> dict:
    """Tokens/s free vs constrained, in alternating rounds on the same requests. The free ones are held to
    the constrained answers' lengths (ignore_eos, max_tokens): the same steps, with and without the mask."""
    picks = [i % len(tasks) for i in range(max(batch, len(tasks)))]
    modes = {"free": [SamplingParams(ignore_eos=True, max_tokens=lengths[i]) for i in picks],
             "constrained": [SamplingParams(structured={"json_schema": tasks[i]["schema"]}) for i in picks]}
    total = {mode: [0, 0.0] for mode in modes}
    for k in range(rounds):   # A B, then B A: neither mode always runs first
        for mode, params in (list(modes.items()) if k % 2 == 0 else list(modes.items())[::-1]):
            groups = [[i] for i in range(len(picks))] if batch == 1 else [list(range(len(picks)))]
            for group in groups:   # batch 1: one request at a time; else all of them together
                results, elapsed = run_all(engine, [prompts[picks[i]] for i in group], [params[i] for i in group])
                total[mode][0] += sum(r.metrics.output_tokens for r in results)
                total[mode][1] += elapsed
            if bar:
                bar.update(1, note=f"speed at batch {batch}, {mode}, round {k + 1}")
    return {mode: {"tokens": n, "seconds": s, "tokens_per_s": n / s, "ms_per_token": s / n * 1e3}
            for mode, (n, s) in total.items()}


def plot(path: str, valid: dict, speeds: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes, kinds = ("free", "constrained"), ("valid", "parses", "broken")
    colours = {"valid": "tab:green", "parses": "tab:orange", "broken": "tab:red"}
    bottom = [0, 0]
    for kind in kinds:
        n = [valid["counts"][m][kind] for m in modes]
        left.bar(modes, n, bottom=bottom, label=kind, color=colours[kind])
        bottom = [b + v for b, v in zip(bottom, n)]
    left.set_title("answers: valid JSON of the schema?")
    left.set_ylabel("answers")
    left.legend(loc="center")
    labels = [f"batch {b}" for b in speeds]
    x = range(len(labels))
    for k, mode in enumerate(modes):
        right.bar([i + 0.4 * k for i in x], [speeds[b][mode]["ms_per_token"] for b in speeds], 0.4, label=mode)
    right.set_xticks([i + 0.2 for i in x], labels)
    right.set_ylabel("ms of wall time per output token")
    right.set_title("time per output token")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\n[plot] {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 11: free vs constrained JSON, validity and cost.")
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--seeds", type=cli.integer(0, 16), default=2, help="seeded samples per task, beside greedy")
    parser.add_argument("--rounds", type=cli.integer(1, 10), default=4, help="alternating rounds of the speed test")
    parser.add_argument("--small", action="store_true", help="a quick look: one seed, batch 1 only")
    parser.add_argument("--plot", type=cli.plot_file(), default=None, metavar="FILE")
    args = parser.parse_args()
    engine = LLM(args.model, device=args.device)
    tasks = load_tasks()
    prompts = [render_chat(engine.tokenizer, [{"role": "user", "content": t["prompt"]}]) for t in tasks]

    print("\n[Compiling each schema against the vocabulary: once, then cached]")
    out = engine.output
    compiler_for(engine.tokenizer, out.vocab_size, tuple(sorted(out.eos_token_ids)))   # the vocabulary, once
    for task in tasks:
        spec = SamplingParams(structured={"json_schema": task["schema"]}).structured
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            compile_spec(engine.tokenizer, out.vocab_size, tuple(sorted(out.eos_token_ids)), spec)
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"  {task['name']:8s} compile {times[0]:6.2f} ms, again {times[1]:5.3f} ms")

    seeds = 1 if args.small else args.seeds
    batches = (1,) if args.small else (1, 32)
    # Every pass over the tasks, counted ahead so that the progress lines can say how long is left.
    passes = 2 * (1 + seeds) + 2 * args.rounds * len(batches)
    progress.say(f"[plan] {passes} passes: validity 2 x {1 + seeds}, then speed 2 x {args.rounds} rounds at batch "
                 f"{' and '.join(map(str, batches))}" + ("" if args.small else "; --small is a quicker look"))
    bar = progress.Progress(passes, "passes", "structured")
    valid = validity(engine, tasks, prompts, seeds, bar)
    print(f"\n[Greedy answers, free vs constrained]  ({len(tasks)} tasks, budget {BUDGET} tokens)")
    for name, pair in valid["examples"].items():
        schema = next(t["schema"] for t in tasks if t["name"] == name)
        for mode, result in pair.items():
            text = " ".join(result.text.split())
            print(f"  {name:8s} {mode:11s} {verdict(result.text, schema):6s} {text[:86]!r}")
    n = len(tasks) * (seeds + 1)
    print(f"\n[Validity over {n} answers each: greedy + {seeds} seeded sample{'' if seeds == 1 else 's'} (temperature 0.7) per task]")
    for mode, c in valid["counts"].items():
        print(f"  {mode:11s} valid {c['valid']:3d} ({c['valid'] / n:4.0%})   parses but breaks the schema "
              f"{c['parses']:3d}   does not parse {c['broken']:3d}")

    costs = [t for task in tasks for t in mask_cost(
        engine, SamplingParams(structured={"json_schema": task["schema"]}).structured,
        valid["examples"][task["name"]]["constrained"].output_ids)]
    print(f"\n[The mask, per request per step: fill the bitmask, -inf the forbidden logits]\n"
          f"  median {statistics.median(costs):.0f} us, 90th percentile {sorted(costs)[int(0.9 * len(costs))]:.0f} us"
          f" over {len(costs)} steps")

    speeds = {}
    lengths = [len(valid["examples"][t["name"]]["constrained"].output_ids) for t in tasks]
    for batch in batches:
        speeds[batch] = s = speed(engine, tasks, prompts, lengths, batch, args.rounds, bar)
        print(f"\n[Speed, batch {batch}: the same requests and lengths, {args.rounds} alternating round{'' if args.rounds == 1 else 's'}]")
        for mode in ("free", "constrained"):
            print(f"  {mode:11s} {s[mode]['tokens']:5d} tokens  {s[mode]['tokens_per_s']:7.1f} tokens/s  "
                  f"{s[mode]['ms_per_token']:6.2f} ms/token")
        print(f"  constrained / free tokens/s: {s['constrained']['tokens_per_s'] / s['free']['tokens_per_s']:.3f}")
        share = statistics.median(costs) / 1e3 / s["free"]["ms_per_token"]   # one mask per output token
        print(f"  the mask's own time (median, above) per output token: {share:.2%} of the free time per token")
    bar.close()
    if args.plot:
        plot(args.plot, valid, speeds)


if __name__ == "__main__":
    main()
