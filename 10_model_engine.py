"""10_model_engine.py - Chapter 6: Chapter 2's decode loop, on the model we own.

`ModelEngine` keeps everything the earlier engines agreed on (the interface, the
detokenizer and stop strings, per-request generators, TTFT/TPOT) and replaces the
HF model with `10_model.LlamaModel`. Because that model takes ragged batches,
`generate_batch` needs no padding: all prompts go through one prefill forward, and
afterwards only the sequences that are still running join each decode step.

    python 10_model.py                      # shape, the usual answer, our logits vs HF's
    python 10_model.py --profile --plot ch6-profile.png   # where one decode step's time goes
"""

from __future__ import annotations

import json
import importlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

setup = importlib.import_module("01_setup")
engine04 = importlib.import_module("04_engine")
decode_loop = importlib.import_module("07_decode_loop")
model10 = importlib.import_module("10_model")
from kit import cli
SamplingParams, GenerateResult = engine04.SamplingParams, engine04.GenerateResult
Sequence = decode_loop.Sequence

DEFAULT_KV_MEMORY = 2 << 30   # bytes of KV cache one generate_batch chunk may allocate


class ModelEngine(decode_loop.DecodeLoopEngine):
    """Chapter 6: the decode loop of Chapter 2 on LlamaModel, with real ragged batches."""

    # --8<-- [start:init]
    def __init__(self, model_name: str | None = None, device: str | None = None,
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 32,
                 kv_memory: int = DEFAULT_KV_MEMORY):
        from transformers import AutoTokenizer   # the tokenizer only: no HF modelling code

        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if not isinstance(kv_memory, int) or kv_memory < 1:
            raise ValueError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
        self.model_name = model_name or setup.DEFAULT_MODEL
        self.device = setup.pick_device(device)
        self.folder = Path(setup.resolve_model(model_name))
        if not self.folder.is_dir():   # a hub id: fetch its files once, where a hub is reachable
            from huggingface_hub import snapshot_download
            self.folder = Path(snapshot_download(str(self.folder), allow_patterns=["*.json", "*.safetensors"]))
        print(f"[engine] loading {self.model_name} into LlamaModel on {self.device} ...", flush=True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        self.model = model10.LlamaModel.from_folder(self.folder, dtype, self.device)
        self.context_length = self.model.config.max_position_embeddings
        self.max_batch_size, self.kv_memory = max_batch_size, kv_memory
        self.eos_token_ids = self._eos_ids()
        print("[engine] ready", flush=True)
    # --8<-- [end:init]

    def _eos_ids(self) -> set[int]:
        """EOS ids from generation_config.json (else config.json), plus the tokenizer's."""
        eos = None
        for name in ("generation_config.json", "config.json"):
            if (self.folder / name).exists() and eos is None:
                eos = json.loads((self.folder / name).read_text()).get("eos_token_id")
        eos = eos if isinstance(eos, list) else [eos]
        return {e for e in eos + [self.tokenizer.eos_token_id] if e is not None}

    # --8<-- [start:run]
    def run(self, prompts: list[list[int]], seqs: list[Sequence]) -> Iterator[list[str]]:
        """Prefill every prompt in one ragged forward, then decode the live sequences together.

        Sequence i owns cache row i. Yields, after every step, each sequence's new text
        ("" for a finished one). A finished sequence leaves the batch at once: its row is
        simply not in the next step's batch, so nobody computes tokens it does not want.
        """
        n = len(seqs)
        max_len = max(len(p) + s.budget for p, s in zip(prompts, seqs))
        cache = self.model.new_cache(n, max_len)
        cached = [len(p) for p in prompts]          # tokens each row holds after the prefill
        batch = model10.RaggedBatch.build(prompts, list(range(n)), [0] * n, max_len, self.device)
        logits = self.model.forward(batch, cache)
        live = list(range(n))
        while True:
            tokens = self.sample(logits, [seqs[i] for i in live])
            now, pieces = time.perf_counter(), [""] * n
            for i, token in zip(live, tokens):
                pieces[i] = self.accept(seqs[i], token, now)
            yield pieces
            step = [(i, t) for i, t in zip(live, tokens) if seqs[i].finish_reason is None]
            if not step:
                return
            live = [i for i, _ in step]
            batch = model10.RaggedBatch.build([[t] for _, t in step], live, [cached[i] for i in live],
                                              max_len, self.device)
            for i in live:
                cached[i] += 1
            logits = self.model.forward(batch, cache)
    # --8<-- [end:run]

    def _encode_ids(self, prompt: str, budget: int) -> list[int]:
        return self.encode(prompt, budget)[0].tolist()   # Chapter 1's checks, then plain ids

    # --8<-- [start:generate]
    def generate_stream(self, prompt: str, max_new_tokens: int,
                        params: SamplingParams | None = None) -> Iterator[str | GenerateResult]:
        t0 = time.perf_counter()
        params = SamplingParams.or_default(params)
        budget = params.token_budget(max_new_tokens)
        ids = self._encode_ids(prompt, budget)
        seq = self.new_sequence(params, budget, len(ids), ids)
        loop = self.run([ids], [seq])
        try:
            for (piece,) in loop:
                if piece:
                    yield piece
        finally:
            loop.close()       # a caller that stops reading stops the work at the next token
        yield self.result(seq, t0)

    def generate_batch(self, prompts: list[str], max_new_tokens: int,
                       params: SamplingParams | None = None) -> list[GenerateResult]:
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings")
        t0 = time.perf_counter()           # every request was submitted now: TTFT counts from here
        params = SamplingParams.or_default(params)
        budget = params.token_budget(max_new_tokens)
        encoded = [self._encode_ids(p, budget) for p in prompts]   # refuse bad input before any work
        results = []
        for chunk in self.batch_chunks(encoded, budget):
            seqs = [self.new_sequence(params, budget, len(ids), ids) for ids in encoded[chunk]]
            for _ in self.run(encoded[chunk], seqs):
                pass
            results += [self.result(s, t0) for s in seqs]
        return results

    def batch_chunks(self, encoded: list[list[int]], budget: int) -> Iterator[slice]:
        """Consecutive prompts whose contiguous KV regions (longest prompt + budget each) fit in kv_memory."""
        per_token = self.model.config.kv_bytes_per_token(self.model.dtype)
        start = 0
        while start < len(encoded):
            end = start + 1
            while (end < len(encoded) and end - start < self.max_batch_size
                   and (end + 1 - start) * (max(map(len, encoded[start:end + 1])) + budget) * per_token
                   <= self.kv_memory):
                end += 1
            yield slice(start, end)
            start = end
    # --8<-- [end:generate]


# ---------------------------------------------------------------- the demonstration
def compare_logits(engine: ModelEngine, prompt: str, steps: int = 8) -> tuple[float, float]:
    """Max |ours - HF| over the prompt's prefill logits and over `steps` greedy decode steps."""
    _, hf = setup.load_model(str(engine.folder), device=engine.device, dtype=engine.model.dtype)
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids.to(engine.device)
    greedy_ids = engine.generate(prompt, steps, SamplingParams(ignore_eos=True)).output_ids
    full = torch.cat([ids[0], torch.tensor(greedy_ids[:-1], device=engine.device)])
    with torch.inference_mode():
        reference = hf(full.unsqueeze(0)).logits[0].float()
    n = ids.shape[1]
    cache = engine.model.new_cache(1, len(full))
    batch = model10.RaggedBatch.build([ids[0].tolist()], [0], [0], len(full), engine.device)
    ours = [engine.model.forward(batch, cache, all_logits=True)]
    for t, token in enumerate(greedy_ids[:-1]):   # then one token at a time, through our cache
        step = model10.RaggedBatch.build([[token]], [0], [n + t], len(full), engine.device)
        ours.append(engine.model.forward(step, cache))
    ours = torch.cat(ours)
    return float((ours[:n] - reference[:n]).abs().max()), float((ours[n:] - reference[n:]).abs().max())


def main() -> None:
    profile = importlib.import_module("10_profile")
    parser = engine04.demo_parser("Chapter 6: the decode loop on a Llama we wrote ourselves.")
    parser.add_argument("--profile", action="store_true", help="time the parts of one decode step")
    parser.add_argument("--plot", metavar="PNG", type=cli.plot_file(), default=None,
                        help="with --profile: save a bar chart")
    args = parser.parse_args()
    if args.plot and not args.profile:
        parser.error("--plot draws the profile: add --profile")
    engine, prompt, _ = engine04.demo(ModelEngine, args)
    m, c = engine.model, engine.model.config
    print(f"\n[Model]  {c.num_layers} layers, {c.num_heads} heads, {c.num_kv_heads} KV heads, head_dim "
          f"{c.head_dim}, hidden {c.hidden_size}, MLP {c.intermediate_size}, vocab {c.vocab_size}")
    print(f"  {m.num_parameters / 1e6:.1f} M parameters, {m.weight_bytes / 1e6:.0f} MB of "
          f"{str(m.dtype).removeprefix('torch.')} weights (LM head tied: {c.tie_word_embeddings})")
    per_token = c.kv_bytes_per_token(m.dtype)
    cache = m.new_cache(1, 1000)
    print(f"  KV cache: 2 x {c.num_layers} x {c.num_kv_heads} x {c.head_dim} x "
          f"{torch.empty((), dtype=m.dtype).element_size()} bytes = {per_token:,} bytes/token; "
          f"allocated for 1,000 tokens: {cache.nbytes:,} bytes -> {cache.nbytes // 1000:,}/token")
    prefill_diff, decode_diff = compare_logits(engine, prompt)
    print(f"\n[Logits vs HF, same prompt]  max |ours - HF|: prefill {prefill_diff:.2e}, "
          f"8 decode steps {decode_diff:.2e}")
    if args.profile:
        table = profile.profile_decode(engine)
        profile.print_profile(table)
        if args.plot:
            profile.plot_profile(table, args.plot)


if __name__ == "__main__":
    main()
