"""10_model.py - Chapter 6: a model we own. The Llama forward pass in plain PyTorch.

Every engine so far handed token ids to Hugging Face's `model(...)` and got logits
back. Paged KV caches, continuous batching and quantisation all change what happens
*inside* that call, so this chapter writes the call itself, in plain torch ops:

    embedding -> 30 x [ RMSNorm -> attention (RoPE, grouped-query) -> + residual
                        RMSNorm -> SwiGLU MLP                      -> + residual ]
              -> RMSNorm -> LM head (the embedding matrix again, when tied)

Two choices make it an engine's model rather than a research model:

    a flat, ragged batch   the new tokens of all sequences concatenated into one
                           [total_tokens] vector, with per-sequence lengths, so one
                           forward can carry one request's prefill next to other
                           requests' single decode tokens
    a KV cache we own      plain tensors we allocate; each new key/value is written
                           to its *slot* (row * max_len + position) by one index_copy

Weights come from `config.json` and `model.safetensors` via the safetensors package;
transformers only supplies the tokenizer (and is the reference we check against).
The model runner (one step: prepare -> forward -> sample) is `10_model_runner.py`, the
engine `10_model_engine.py`, the profiler `10_profile.py`.

    python 10_model.py                  # the model's shape, a greedy answer, our logits vs HF's
    python 10_profile.py                # where one decode step's time goes
"""

from __future__ import annotations

import torch

from kit import cli
from minivllm.batch import RaggedBatch
from minivllm.model import LlamaModel
from minivllm.model_files import load_hf_model, resolve_model

# The model itself (config, RoPE, forward pass): minivllm/model.py; the ragged batch and the
# KV cache of rows: minivllm/batch.py; a weight as a linear operation: minivllm/weights.py


# ---------------------------------------------------------------- the demonstration
@torch.inference_mode()
def compare_logits(model: LlamaModel, hf_model, ids: list[int], steps: int = 8) -> tuple[list[int], float, float]:
    """Greedy tokens through our model and its cache, and max |ours - HF| over the prompt's prefill
    logits and over `steps` decode steps (HF sees the whole sequence at once: no cache at all)."""
    n, cache = len(ids), model.new_cache(1, len(ids) + steps)
    ours = [model.forward(RaggedBatch.build([ids], [0], [0], n + steps, model.device), cache, all_logits=True)]
    tokens = [int(ours[0][-1].argmax())]
    for t in range(steps - 1):      # then one token at a time, through our cache
        ours.append(model.forward(RaggedBatch.build([[tokens[-1]]], [0], [n + t], n + steps, model.device), cache))
        tokens.append(int(ours[-1][-1].argmax()))
    ours = torch.cat(ours)
    full = torch.tensor([ids + tokens[:-1]], device=model.device)
    reference = hf_model(full).logits[0].float()
    return tokens, float((ours[:n] - reference[:n]).abs().max()), float((ours[n:] - reference[n:]).abs().max())


def main() -> None:
    import argparse

    import transformers

    parser = argparse.ArgumentParser(description="Chapter 6: our Llama forward pass, checked against HF's.")
    cli.add_model_flags(parser, device=False)
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    transformers.utils.logging.disable_progress_bar()   # HF's loading bar would cut into the output below
    try:
        tokenizer, hf = load_hf_model(str(folder), "cpu", torch.float32)
        model = LlamaModel.from_folder(folder)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    m, c = model, model.config
    print(f"[Model]  {c.num_layers} layers, {c.num_heads} heads, {c.num_kv_heads} KV heads, head_dim "
          f"{c.head_dim}, hidden {c.hidden_size}, MLP {c.intermediate_size}, vocab {c.vocab_size}")
    print(f"  {m.num_parameters / 1e6:.1f} M parameters, {m.weight_bytes / 1e6:.0f} MB of "
          f"{str(m.dtype).removeprefix('torch.')} weights (LM head tied: {c.tie_word_embeddings})")
    per_token, cache = c.kv_bytes_per_token(m.dtype), m.new_cache(1, 1000)
    print(f"  KV cache: 2 x {c.num_layers} x {c.num_kv_heads} x {c.head_dim} x "
          f"{torch.empty((), dtype=m.dtype).element_size()} bytes = {per_token:,} bytes/token; "
          f"allocated for 1,000 tokens: {cache.nbytes:,} bytes -> {cache.nbytes // 1000:,}/token")
    tokens, prefill_diff, decode_diff = compare_logits(model, hf, tokenizer(args.prompt).input_ids)
    print(f"\n[Greedy, our forward]  {args.prompt!r} -> {tokenizer.decode(tokens)!r}")
    print(f"[Logits vs HF, same tokens]  max |ours - HF|: prefill {prefill_diff:.2e}, "
          f"{len(tokens)} decode steps {decode_diff:.2e}")


if __name__ == "__main__":
    main()
