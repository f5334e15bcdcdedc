"""kit/demo.py - what every engine script shares: its flags, one request, the three blocks it prints.

`python NN_engine.py` sends one prompt through a chapter's engine and prints [Prompt], [Output]
(streamed where the engine streams) and [Metrics]; `engine_main` adds a flag for each feature
the engine's constructor takes (kit/cli.py's engine options) and runs it.
"""

from __future__ import annotations

import argparse
import inspect

from kit import cli
from minivllm import model_files
from minivllm.contracts import BaseOfflineEngine, SamplingParams
from minivllm.text import render_chat


def demo_parser(description: str) -> argparse.ArgumentParser:
    """The command-line flags every engine script shares (later chapters add their own)."""
    parser = argparse.ArgumentParser(description=description)
    cli.add_model_flags(parser, threads=True)
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the answer's budget in tokens (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=model_files.DTYPE_NAMES,
                        help="weights' precision (default auto: bfloat16 on a GPU, float32 elsewhere)")
    return parser


# --8<-- [start:demo]
# The unit of each number RequestMetrics can carry: a bare "3.2" could be seconds or tokens/s.
METRIC_UNITS = {"throughput": "tokens/s", "input_tokens": "tokens", "output_tokens": "tokens",
                "ttft_ms": "ms", "tpot_ms": "ms", "queue_ms": "ms", "cached_tokens": "tokens",
                "draft_tokens": "tokens", "accepted_tokens": "tokens"}


def metric_lines(metrics) -> list[str]:
    """One '  name  value unit' line per measured metric (what was not measured is left out)."""
    lines = []
    for name, value in metrics.as_dict().items():
        if name not in METRIC_UNITS:
            raise ValueError(f"metric {name!r} has no unit: add it to METRIC_UNITS")
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        lines.append(f"  {name:<15} {shown} {METRIC_UNITS[name]}")
    return lines


def print_streamed(pieces, indent: str = "  ") -> object:
    """Print text pieces as they arrive, indented like the other blocks, and return what followed
    them (the GenerateResult). Leading and trailing whitespace is held back, as strip() would:
    trailing spaces are printed only once more text follows them."""
    pending, started, result = "", False, None
    print(indent, end="", flush=True)
    for piece in pieces:
        if not isinstance(piece, str):
            result = piece
            continue
        text = pending + piece
        if not started:
            text = text.lstrip()
        body = text.rstrip()
        pending = text[len(body):]
        if body:
            started = True
            print(body.replace("\n", "\n" + indent), end="", flush=True)
    print()
    return result


def demo(engine_class: type[BaseOfflineEngine], args: argparse.Namespace, **engine_kwargs):
    """Build the engine, send one request, print [Prompt], [Output] (streamed as it is generated,
    where the engine can stream) and [Metrics]. engine_kwargs: the engine's own features."""
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        engine = engine_class(args.model, device=args.device, dtype=args.dtype, **engine_kwargs)
        prompt = args.prompt if args.raw else render_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
        print(f"\n[Prompt]\n  {args.prompt}" + ("" if args.raw else "   (sent through the chat template)"))
        print("\n[Output]")
        if engine.capabilities().streams:   # a reader sees the answer grow, not a silent wait
            result = print_streamed(engine.generate_stream(prompt, args.max_new_tokens, params))
        else:
            result = engine.generate(prompt, args.max_new_tokens, params)
            print(f"  {result.text.strip()}")
    except (ValueError, OSError) as exc:  # bad flags or a model that cannot be found: say so, no traceback
        raise SystemExit(f"error: {exc}") from None

    print("\n[Metrics]")
    print("\n".join(metric_lines(result.metrics)))
    print(f"  {'finish_reason':<15} {result.finish_reason}")
    return engine, prompt, params
# --8<-- [end:demo]


def engine_main(engine_class: type[BaseOfflineEngine], description: str, **defaults):
    """An engine script's main(): the shared flags, plus a flag for each feature the engine's
    constructor takes (kit/cli.py's engine options), then one request through demo().
    defaults: features switched on unless the command line says otherwise."""
    parser = demo_parser(description)
    takes = inspect.signature(engine_class).parameters
    cli.add_engine_options(parser, only=tuple(name for name in cli.ENGINE_OPTIONS   # --dtype, --threads: demo_parser's
                                              if name in takes and name not in ("dtype", "threads")))
    parser.set_defaults(**defaults)
    args = parser.parse_args()
    # only what the engine takes: demo_parser's own --seed is the request's, not an engine option
    features = {name: value for name, value in cli.engine_options(args).items() if name in takes and name != "dtype"}
    return demo(engine_class, args, **features)
