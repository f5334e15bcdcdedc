"""21_adapters.py - Chapter 17: one base, many adapters. LoRA fine-tunes served side by side.

A LoRA fine-tune changes each chosen weight W by a low-rank product B·A (rank 8: a few hundred
thousand numbers a layer instead of millions), trained while W stays frozen. Merged, each
fine-tune would be a whole model to hold and serve; kept beside the one base, each request's
rows apply their own adapter in the same step: shrink by A, expand by B (minivllm/lora.py).

    1. train  two adapters with peft on the CPU, each on 16 answers with a visible habit
              (data/adapter_habits.json), saved as peft saves them (cached, not committed)
    2. serve  the base and both adapters in one engine; one prompt answered three ways in one batch
    3. check  each adapter's answer equals HF's model with it merged (merge_and_unload)
    4. measure a 32-row decode step with 0, 1, 4 and 8 distinct adapters, against the base alone

    python 21_adapters.py                 # train (a minute or two per adapter the first time), serve, check
    python 21_adapters.py --measure       # ... then the step times
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kit import cli
from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.model_files import cache_dir, resolve_model
from minivllm.text import chat_ids

HABITS = Path(__file__).resolve().parent / "data" / "adapter_habits.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --8<-- [start:train]
def train_adapter(model_dir: str, pairs: list[list[str]], out: Path, steps: int, rank: int = 8) -> float:
    """A LoRA adapter on all seven projections, trained on chat-formatted (question, answer)
    pairs, only the answer's tokens in the loss; saved with peft's save_pretrained. Seconds taken."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start, tokenizer = time.perf_counter(), AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    examples = []
    for question, answer in pairs:
        prompt = chat_ids(tokenizer, [{"role": "user", "content": question}])
        reply = tokenizer(answer + "<|im_end|>", add_special_tokens=False).input_ids
        examples.append((torch.tensor([prompt + reply]), torch.tensor([[-100] * len(prompt) + reply])))
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    for step in range(steps):
        ids, labels = examples[step % len(examples)]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        if step % 16 == 15:
            print(f"  step {step + 1:3d}/{steps}  loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    return time.perf_counter() - start
# --8<-- [end:train]


def adapters(model_dir: str, steps: int) -> dict[str, LoRARequest]:
    """Both adapters, trained once and cached beside the models."""
    habits, out = json.loads(HABITS.read_text())["habits"], {}
    for i, (habit, pairs) in enumerate(habits.items(), start=1):
        folder = cache_dir().parent / "adapters" / f"{Path(model_dir).name}-{habit}-{steps}"
        if not (folder / "adapter_model.safetensors").is_file():
            print(f"[train] {habit}: {len(pairs)} answers, {steps} steps on {torch.get_num_threads()} threads", flush=True)
            print(f"[train] {habit}: done in {train_adapter(model_dir, pairs, folder, steps):.0f} s", flush=True)
        out[habit] = LoRARequest(habit, i, str(folder))
    return out


# --8<-- [start:serve]
def three_ways(llm: LLM, loras: dict[str, LoRARequest], question: str) -> list[str]:
    """One question, answered by the base and by each adapter, in one batch."""
    ids = chat_ids(llm.tokenizer, [{"role": "user", "content": question}])
    who = [None, *loras.values()]
    results = llm.generate([ids] * len(who), SamplingParams(max_tokens=24), lora_request=who)
    for lora, result in zip(who, results):
        print(f"  {'base' if lora is None else lora.lora_name:>7}: {result.text.strip()!r}")
    return [r.output_ids for r in results]
# --8<-- [end:serve]


def check_against_merged(model_dir: str, lora: LoRARequest, question: str, tokens: list[int]) -> bool:
    """HF's base with the adapter merged in, greedy: our tokens must be its tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                       lora.lora_path).merge_and_unload().eval()
    ids = torch.tensor([chat_ids(tokenizer, [{"role": "user", "content": question}])])
    with torch.no_grad():
        theirs = merged.generate(ids, max_new_tokens=len(tokens), do_sample=False)[0, ids.shape[1]:].tolist()
    same = theirs[:len(tokens)] == tokens
    print(f"  {lora.lora_name:>7}: {'equal to' if same else 'DIFFERENT from'} HF's merged model, {len(tokens)} tokens")
    return same


# --8<-- [start:measure]
def measure(model_dir: str, loras: dict[str, LoRARequest], repeats: int) -> None:
    """32 rows decoding 16 tokens each, with 0, 1, 4 and 8 distinct adapters (copies of the two
    trained ones under new ids: the same cost as eight different ones), alternated, medians."""
    base = list(loras.values())
    copies = [LoRARequest(f"{base[i % 2].lora_name}{i}", 100 + i, base[i % 2].lora_path) for i in range(8)]
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(32)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with LLM(model_dir, enable_lora=True, max_loras=8, max_lora_rank=8, max_num_seqs=32) as llm:
        llm.generate(prompts, params, lora_request=[copies[i % 8] for i in range(32)])   # warm, slots filled
        times: dict[int, list[float]] = {0: [], 1: [], 4: [], 8: []}
        for _ in range(repeats):
            for k in times:
                who = [copies[i % k] if k else None for i in range(32)]
                start = time.perf_counter()
                llm.generate(prompts, params, lora_request=who if k else None)
                times[k].append(time.perf_counter() - start)
        print(f"[measure] 32 rows x 16 tokens, median of {repeats} alternating runs (min-max):")
        base_t = statistics.median(times[0])
        for k, ts in times.items():
            print(f"  {k} adapter{'' if k == 1 else 's'}: {statistics.median(ts) / base_t:.2f}x the base  "
                  f"({min(ts) / base_t:.2f}-{max(ts) / base_t:.2f})")
        print(f"[measure] device slots: {llm.lora.slot_bytes / 1e6:.1f} MB for 8 adapters of rank 8; "
              f"one adapter in host memory: {llm.lora.add(base[0]).nbytes / 1e6:.1f} MB")
# --8<-- [end:measure]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_model_flags(parser, device=False, threads=True)
    parser.add_argument("--steps", type=cli.integer(1, 10_000), default=96, help="training steps per adapter")
    parser.add_argument("--measure", action="store_true", help="time a 32-row step with 0, 1, 4, 8 adapters")
    parser.add_argument("--repeats", type=cli.integer(1, 20), default=3)
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    loras = adapters(model_dir, args.steps)
    question = json.loads(HABITS.read_text())["held_out"]
    with LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        print(f"[serve] {question!r}, three ways in one batch:")
        answers = three_ways(llm, loras, question)
    print("[check] greedy tokens against HF's base with each adapter merged, float32:")
    for lora, tokens in zip(loras.values(), answers[1:]):
        check_against_merged(model_dir, lora, question, tokens)
    if args.measure:
        measure(model_dir, loras, args.repeats)
    print(f"[machine] {torch.get_num_threads()} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
