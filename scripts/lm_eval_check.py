"""lm_eval_check.py - lm-evaluation-harness, unchanged, scoring answers through 05_server.py.

Starts 05_server.py with the assembled engine (minivllm:LLM), runs EleutherAI's harness against
it as any evaluator would (`lm_eval --model local-completions`, its default arguments, the model
folder as its tokenizer) on the two small tasks in evals/, then checks every answer's
log-likelihood the server gave against HF transformers' float32 forward on the same tokens.

The harness is not a dependency of this project: it lives in a venv of its own,
made once by scripts/peers/install_lm_eval.sh (or point --lm-eval at any `lm_eval` executable).

    python scripts/lm_eval_check.py                       # both tasks, then the comparison
    python scripts/lm_eval_check.py --samples DIR         # only the comparison, on a run's --log_samples
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
DEFAULT_LM_EVAL = "/tmp/peers/lm_eval/bin/lm_eval"
TASKS = "tiny_capitals,tiny_continue"
TOLERANCE = 2e-3   # nats, on each answer's summed log-likelihood


def run_harness(lm_eval: str, model_dir: str, out: Path, timeout_s: float) -> None:
    from kit import launcher
    with launcher.serve_in_subprocess(engine="minivllm:LLM", startup_timeout_s=600) as url:
        args = [lm_eval, "--model", "local-completions", "--model_args",
                f"model={Path(model_dir).name},base_url={url}/v1/completions,tokenizer={model_dir}",
                "--tasks", TASKS, "--include_path", "evals", "--output_path", str(out), "--log_samples"]
        shown = " ".join(args).replace(url, "http://127.0.0.1:8001").replace(str(out), "OUT")
        print(f"$ {shown.replace(lm_eval, 'lm_eval').replace(model_dir, '<model folder>')}", flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise SystemExit(f"lm_eval exited with {done.returncode}:\n{done.stderr[-3000:]}")
        print(done.stdout.strip())   # the harness's own table of results


# --8<-- [start:compare]
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split of a request into context and answer tokens (lm_eval's _encode_pair):
    trailing spaces move to the answer, the whole text is tokenised once, then cut."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def compare(samples_dir: Path, model_dir: str) -> float:
    """Each multiple-choice answer's log-likelihood from the server beside HF float32's; the worst gap."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    [path] = sorted(samples_dir.rglob("samples_tiny_capitals_*.jsonl"))
    worst, rows = 0.0, []
    for doc in map(json.loads, path.read_text().splitlines()):
        for args, resp in zip(doc["arguments"].values(), doc["resps"]):
            ctx, cont = encode_pair(tokenizer, args["arg_0"], args["arg_1"])
            with torch.no_grad():
                lp = hf(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
            ref = sum(lp[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))
            served = float(resp[0][0])
            worst = max(worst, abs(served - ref))
            rows.append((doc["doc"]["question"], args["arg_1"].strip(), served, ref))
    print(f"\n{'question':34} {'answer':11} {'server':>9} {'HF fp32':>9} {'gap':>8}")
    for question, answer, served, ref in rows:
        print(f"{question[:34]:34} {answer[:11]:11} {served:9.4f} {ref:9.4f} {abs(served - ref):8.1e}")
    print(f"{len(rows)} answers; the largest gap is {worst:.1e} nats (tolerance {TOLERANCE:g})")
    return worst
# --8<-- [end:compare]


def main() -> int:
    from minivllm.model_files import DEFAULT_MODEL, resolve_model
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default=os.environ.get("LM_EVAL", DEFAULT_LM_EVAL),
                        help=f"the harness's executable (default: $LM_EVAL or {DEFAULT_LM_EVAL})")
    parser.add_argument("--samples", type=Path, help="compare a finished run's --log_samples folder; run nothing")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds the harness may take")
    args = parser.parse_args()
    model_dir = str(resolve_model(DEFAULT_MODEL))
    if args.samples is None:
        if not Path(args.lm_eval).exists():
            parser.error(f"no lm_eval at {args.lm_eval}: run scripts/peers/install_lm_eval.sh, or pass --lm-eval")
        out = Path(tempfile.mkdtemp(prefix="lm_eval_"))
        run_harness(args.lm_eval, model_dir, out, args.timeout)
        args.samples = out
    return 0 if compare(args.samples, model_dir) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
