"""Chapter 12: weight formats round-trip within their bounds, the packed kernels agree
with the dequantise-then-matmul reference, and quantised engines stay close to float32."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script
from kit.engines import load_engine
from kit.quant_modes import parse_mode
from minivllm import LLM
from minivllm.batch import RaggedBatch
from minivllm.contracts import SamplingParams
from minivllm.model import LlamaModel
from minivllm.model_runner import load_model
from minivllm.quantization import (GROUP_SIZES, HalfWeight, Int4Weight, Int8Weight, W8A8Weight, WeightFormat,
                                   dequantize_int4, dequantize_int8, format_name_of, inner_k_tiles, pack_pairs, quantize,
                                   quantize_int4, quantize_int8)

engine16 = load_script("16_quantization_engine")
demo16 = load_script("16_quantization_demo")


def random_weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with the features that make quantisation hard: an outlier, a lopsided row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 5] = 1.0             # one outlier stretches its row's (int8) or group's (int4) scale
    w[7] = w[7].abs() + 0.3   # an all-positive row: asymmetric int4 still uses all 16 levels
    return w


def test_int8_round_trip_within_half_a_step():
    w = random_weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) == 127                               # the row maximum uses the full range
    error = (dequantize_int8(q, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())  # rounding to the nearest step


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int4_round_trip_within_half_a_step_per_group(group_size):
    w = random_weight()
    q, scale, zero = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (w.shape[0], w.shape[1] // group_size)
    error = (dequantize_int4(q, scale, zero) - w).abs()
    # Half a step, plus what storing the zero point in bf16 (8 significant bits) may shift a clamped end.
    bound = scale.float() / 2 * (1 + 1e-5) + zero.float().abs() * 2 ** -9
    assert bool((error <= bound.repeat_interleave(group_size, dim=1)).all())
    assert float(error.mean()) < float(scale.float().mean()) / 3   # mostly well inside the bound


def make(kind: str, w: torch.Tensor, path: str):
    if kind in ("bf16", "fp16"):
        return HalfWeight(w, {"bf16": torch.bfloat16, "fp16": torch.float16}[kind], path)
    if kind == "int8":
        return Int8Weight(w, path)
    if kind == "w8a8":
        return W8A8Weight(w, path)
    return Int4Weight(w, int(kind.removeprefix("int4-g")), path)


@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8"] + [f"int4-g{g}" for g in GROUP_SIZES])
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_fast_path_equals_reference_path(kind, tokens):
    """The kernels read bf16 activations and write bf16 results (8 significant bits), so each
    product in a dot product may be off by ~2^-8 relative: the bound is 2^-7 of sum |x||w|."""
    w = random_weight()
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(1))
    fast, reference = make(kind, w, "fast"), make(kind, w, "reference")
    exact = x.double() @ reference.dequantize().double().T
    scale = x.abs().double() @ reference.dequantize().abs().double().T
    assert float(((reference.matmul(x).double() - exact).abs() / scale).max()) < 1e-5   # float32 matmul
    got = fast.matmul(x)
    assert got.dtype == x.dtype and got.shape == (tokens, w.shape[0])
    assert float(((got.double() - exact).abs() / scale).max()) < 2 ** -7


@pytest.mark.parametrize("tokens", [1, 7, 17, 32])
def test_w8a8_fast_path_is_the_reference_rounding_summed_exactly(tokens):
    """Both paths round each row of x to int8 with its own scale; the fast one sums the integer
    products exactly in int32, so the two differ only by float32 rounding of the scales. Each row's
    result depends on that row alone: the same whatever else is in the batch."""
    w = random_weight()
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(1)) * 3
    fast, reference = make("w8a8", w, "fast"), make("w8a8", w, "reference")
    scale = x.abs().double() @ reference.dequantize().abs().double().T
    got = fast.matmul(x)
    assert got.dtype == x.dtype and got.shape == (tokens, w.shape[0])
    assert float(((got.double() - reference.matmul(x).double()).abs() / scale).max()) < 1e-5
    assert torch.equal(torch.cat([fast.matmul(x[i:i + 1]) for i in range(tokens)]), got)   # batch-invariant
    exact = x.double() @ reference.dequantize().double().T   # the activations' rounding: half a step per element
    assert float(((got.double() - exact).abs() / scale).max()) < x.abs().max() / x.abs().mean() / 254
    assert fast.nbytes == w.numel() + w.shape[0] * 4 and fast.q_t.is_contiguous()   # one copy of the codes


def test_fast_int4_is_smaller_than_reference_and_int8():
    w = random_weight()
    int4, int8 = Int4Weight(w, 32), Int8Weight(w)
    # packed int4: half a byte per weight, plus bf16 scale and zero per 32 weights (5 bits in all)
    assert int4.nbytes == w.numel() // 2 + w.numel() // 32 * 4
    assert int4.nbytes < int8.nbytes < w.numel() * 4
    with pytest.raises(ValueError, match="packed"):
        int4.dequantize()


def test_cuda_int4_packing_fits_the_inner_k_tiles_to_the_layer():
    """CUDA's packer lays 2, 4 or 8 k-tiles of 16 inputs side by side and refuses a k they do
    not divide: SmolLM2's 576 inputs (36 tiles) need 4, not 8. The CUDA branch is checked on
    the meta device, which computes the packed shape without data (or a GPU)."""
    assert [inner_k_tiles(k) for k in (576, 1536, 4096, 64, 32, 96)] == [4, 8, 8, 4, 2, 2]
    with pytest.raises(ValueError, match="multiple of 32"):
        inner_k_tiles(48)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):   # qkv, o, gate_up, down
        packed = Int4Weight(torch.empty(n, k, device="meta"), 32).packed
        tiles = packed.shape[3] * 2                 # [n / 8, k / (tiles * 16), 32, tiles / 2]
        assert packed.shape[0] * 8 == n and packed.shape[1] * tiles * 16 == k


def test_cuda_int4_packing_reads_the_models_own_layout():
    """The model keeps its layers input-major (column-major); CUDA's packer requires a contiguous
    uint8 tensor of [n, k / 2] code pairs. Packed from the model's own layout, in float32 and
    bf16 (a GPU's dtype), the pairs are what the kernel requires, and decode back to the codes."""
    from minivllm.weights import input_major

    for dtype in (torch.float32, torch.bfloat16):
        w = input_major(torch.randn(96, 64).to(dtype))
        assert not w.is_contiguous()
        q, _, _ = quantize_int4(w, 32)
        pairs = pack_pairs(q)
        assert pairs.is_contiguous() and pairs.dtype == torch.uint8 and pairs.shape == (96, 32)
        assert torch.equal(torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(96, 64), q)


def test_cuda_int4_packer_gets_what_it_requires_from_the_models_own_weights(tiny_model_dir, monkeypatch):
    """The whole model as loaded (layers input-major), moved to the meta device so that the CUDA
    branch runs without a GPU: every tensor handed to CUDA's packer is what its kernel checks
    (contiguous, uint8, [n, k / 2]). The draft model of `speculative="draft"` is this int4 format."""
    real, seen = torch.ops.aten._convert_weight_to_int4pack, []

    def packer(pairs, tiles):
        assert pairs.is_contiguous() and pairs.dtype == torch.uint8 and pairs.dim() == 2
        seen.append((tuple(pairs.shape), tiles))
        return real(pairs, tiles)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", packer)
    base = load_model(tiny_model_dir, torch.float32, "cpu")
    qkv = base.w["model.layers.0.qkv"]
    assert not qkv.is_contiguous() and qkv.T.is_contiguous()          # the model's own layout
    meta = base.with_weights({name: w.to("meta") for name, w in base.w.items()})
    assert not meta.w["model.layers.0.qkv"].is_contiguous()            # .to keeps the strides
    packed = WeightFormat("int4", 32)(meta)
    assert len(seen) == 4 * base.config.num_layers
    n, k = qkv.shape
    assert ((n, k // 2), inner_k_tiles(k)) in seen
    assert packed.w["model.layers.0.qkv"].packed.device.type == "meta"


def test_int4_head_packs_the_head_and_keeps_an_int8_table_for_lookups(tiny_model_dir):
    """Packed int4 rows cannot be read back, so the tied matrix splits: int4 for the logits, int8 for lookups."""
    base = LlamaModel.from_folder(tiny_model_dir)
    assert base.config.tie_word_embeddings
    default = quantize(base, "int4", 32)
    packed = quantize(base, "int4", 32, head="int4")
    assert default.w["lm_head"] is default.w["embed"] and isinstance(default.w["embed"], Int8Weight)
    assert isinstance(packed.w["lm_head"], Int4Weight) and isinstance(packed.w["embed"], Int8Weight)
    assert packed.weight_bytes == default.weight_bytes + packed.w["lm_head"].nbytes
    assert format_name_of("int4", 32, "int4") == "int4 g32, head int4"
    assert format_name_of("int4", 32, "int8") == format_name_of("int4", 32) == "int4 g32"
    ids = list(range(100, 140))
    batch = RaggedBatch.build([ids], [0], [0], len(ids))
    logits = [m.forward(batch, m.new_cache(1, len(ids)), all_logits=True) for m in (default, packed)]
    # the same layers and embedding: only the head's rounding separates the two
    assert 0 < float((logits[0] - logits[1]).abs().max()) < 0.1 * float(logits[0].abs().max())


def test_embedding_rows_come_from_the_int8_table():
    w = random_weight()
    table, rows = Int8Weight(w), torch.tensor([0, 7, 3, 7])
    assert torch.equal(table[rows], table.dequantize()[rows])
    assert table[rows].dtype == torch.float32


@pytest.mark.parametrize("quant,group_size", [("int8", 32), ("int4", 32), ("bf16", 32), ("fp16", 32)])
def test_quantized_model_fast_equals_reference_logits(tiny_model_dir, quant, group_size):
    base = LlamaModel.from_folder(tiny_model_dir)
    fast = quantize(base, quant, group_size)
    reference = quantize(base, quant, group_size, path="reference")
    ids = list(range(100, 140))
    batch = RaggedBatch.build([ids], [0], [0], len(ids))
    got = fast.forward(batch, fast.new_cache(1, len(ids)), all_logits=True)
    want = reference.forward(batch, reference.new_cache(1, len(ids)), all_logits=True)
    exact = base.forward(batch, base.new_cache(1, len(ids)), all_logits=True)
    assert float((got - want).abs().max()) < 0.06 * float(want.abs().max())   # bf16 activations, 2 layers
    assert not torch.equal(want, exact)   # how close to float32 is the real model's question (below)
    assert fast.weight_bytes < base.weight_bytes / (1.9 if quant in ("bf16", "fp16") else 3.5)


def test_weight_format_is_a_step_from_model_to_model(tiny_model_dir, tmp_path):
    """Chapter 12 reaches every engine as an object, WeightFormat: settings are checked when it is
    made, before any weights load; applied, it gives Chapter 6's model over other weights and leaves
    the float model untouched."""
    base = LlamaModel.from_folder(tiny_model_dir)
    to_int4 = WeightFormat("int4", 64, "int8")
    model = to_int4(base)
    assert type(model) is LlamaModel and model.format_name == format_name_of("int4", 64, "int8")
    qkv = model.w["model.layers.0.qkv"]
    assert isinstance(qkv, Int4Weight) and qkv.group_size == 64
    assert isinstance(model.w["embed"], Int8Weight) and isinstance(base.w["model.layers.0.qkv"], torch.Tensor)
    assert base.format_name is None
    reference = WeightFormat("int8", path="reference")(base)
    assert reference.w["model.layers.1.down"].path == "reference" and reference.format_name == "int8"
    # The model runner's loader: the same weights as the step applied by hand.
    loaded = load_model(tiny_model_dir, features=[WeightFormat("int4", 64, "int8")])
    assert type(loaded) is LlamaModel and loaded.format_name == model.format_name
    batch = RaggedBatch.build([list(range(100, 120))], [0], [0], 20)
    assert torch.equal(loaded.forward(batch, loaded.new_cache(1, 20)), model.forward(batch, model.new_cache(1, 20)))
    assert type(load_model(tiny_model_dir)) is LlamaModel      # no steps: the model's own
    for settings, message in (({"quant": "int3"}, "unknown quantisation mode"),
                              ({"quant": "int4", "group_size": 48}, "group size must be one of"),
                              ({"quant": "int8", "head": "int3"}, "unknown head format")):
        with pytest.raises(ValueError, match=message):
            WeightFormat(**settings)


def test_engine_through_load_engine_with_its_flags(tiny_model_dir):
    """06_benchmark and 05_server build an engine from its spec: the format comes from its flags,
    given beside the spec or inside it; without any, QuantizedEngine is int8."""
    engine = load_engine("16_quantization_engine:QuantizedEngine --quant int4 --group-size 64",
                         str(tiny_model_dir), device="cpu", quant_head="f32")
    assert engine.quant == "int4 g64, head f32"
    assert isinstance(engine.model.w["model.layers.0.qkv"], Int4Weight)
    assert isinstance(engine.model.w["lm_head"], torch.Tensor)
    result = engine.generate("The capital of France is", 5, SamplingParams(ignore_eos=True))
    assert len(result.output_ids) == 5 and result.metrics.tpot_ms is not None
    batch = engine.generate_batch(["Hello", "The capital of France is"], 4,
                                  SamplingParams(ignore_eos=True))
    assert [len(r.output_ids) for r in batch] == [4, 4]
    int8 = load_engine("16_quantization_engine:QuantizedEngine", str(tiny_model_dir), device="cpu")
    assert int8.quant == "int8" and isinstance(int8.model.w["embed"], Int8Weight)


# ---------------------------------------------------------------- formats compose with the assembled engine
# A chat service's prompts start alike: the shared text is what a prefix cache can serve the second time.
SHARED_SYSTEM = "You are a helpful assistant of the city library. Answer in one short, friendly sentence. " * 3
N_QUANT = 12


@pytest.fixture(scope="module")
def quantized_reference(tiny_model_dir):
    """Chapter 12's own engine per format (Chapter 6's loop on quantised weights): greedy answers,
    alone and as one batch, each computed once."""
    engines = {quant: engine16.QuantizedEngine(str(tiny_model_dir), device="cpu", quant=quant, group_size=32,
                                               quant_head="auto") for quant in ("int8", "w8a8", "int4")}
    memo = {}

    def answers(quant: str, prompts: tuple[str, ...], batched: bool):
        if (quant, prompts, batched) not in memo:
            e = engines[quant]
            memo[quant, prompts, batched] = e.generate_batch(list(prompts), N_QUANT) if batched else \
                [e.generate(p, N_QUANT) for p in prompts]
        return memo[quant, prompts, batched]
    answers.engines = engines
    return answers


def same_answers(got, want) -> None:
    assert [(r.output_ids, r.text, r.finish_reason) for r in got] == \
        [(r.output_ids, r.text, r.finish_reason) for r in want]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("quant", ["int8", "w8a8", "int4"])
def test_continuous_batching_on_quantised_weights_equals_the_quantised_engine(
        quant, prefix_caching, tiny_model_dir, quantized_reference, reference_prompts):
    """Chapter 9's engine with quant= (and prefix caching, chunked prefills) gives token for token what
    Chapter 12's engine of the same format gives: the format is the model the runner holds, nothing else.
    With the cache on, every prompt runs twice: the second run's prefills start after the cached blocks."""
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=512 * 8 * 512, block_size=8,
                 max_num_seqs=4, max_num_batched_tokens=32, quant=quant, group_size=32,
                 prefix_caching=prefix_caching)
    chunks = []
    engine.on_step = lambda work, events: chunks.extend(
        0 < s < r.n_prompt for r, s in zip(work.requests, work.starts))
    try:
        assert engine.quant == quantized_reference.engines[quant].quant == format_name_of(quant, 32)
        assert engine.features()["quant"] == engine.quant and engine.prefix_caching is prefix_caching
        for prompts in (tuple(reference_prompts), tuple(SHARED_SYSTEM + p for p in reference_prompts)):
            runs = [engine.generate_batch(list(prompts), N_QUANT) for _ in range(2 if prefix_caching else 1)]
            for got in runs:
                same_answers(got, quantized_reference(quant, prompts, batched=True))
            alone = [engine.generate(p, N_QUANT) for p in prompts]
            same_answers(alone, quantized_reference(quant, prompts, batched=False))
            if not prefix_caching:
                assert all(r.metrics.cached_tokens is None for r in runs[0] + alone)
                continue
            # Seen before: every full block but the one holding the prompt's last token came from the cache.
            full_blocks = [(len(engine.tokenizer(p).input_ids) - 1) // 8 * 8 for p in prompts]
            for got in (runs[1], alone):
                assert [r.metrics.cached_tokens for r in got] == full_blocks
            if prompts[0].startswith(SHARED_SYSTEM):
                assert all(r.metrics.cached_tokens > 0 for r in runs[1] + alone)
    finally:
        engine.close()
    assert any(chunks)     # 32 tokens a step: the long prompts were prefilled in chunks
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.blocks.tables


@pytest.mark.real_model
def test_real_model_continuous_batching_int8_equals_the_int8_engine(default_model_dir, reference_prompts):
    """The same on SmolLM2-135M, int8, a few reference prompts (one ends on EOS), 16 new tokens; the cached
    run repeats each batch. Batches are compared with batches: the packed kernels read bf16 activations,
    so a prompt alone and the same prompt next to others can part at a near-tie (reference prompts 2 and 5
    do, in Chapter 12's engine itself); given the same requests, the two engines must agree exactly."""
    want = engine16.QuantizedEngine(str(default_model_dir), device="cpu", quant="int8")
    prompt_sets = [reference_prompts[:4], [SHARED_SYSTEM + p for p in reference_prompts[:2]]]
    expected = [want.generate_batch(prompts, 16) for prompts in prompt_sets]
    assert {r.finish_reason for r in expected[0]} == {"stop", "length"}
    for prefix_caching in (False, True):
        engine = LLM(str(default_model_dir), device="cpu", kv_memory=64 << 20,
                     quant="int8", prefix_caching=prefix_caching)
        try:
            assert engine.quant == want.quant == "int8"
            for prompts, wanted in zip(prompt_sets, expected):
                runs = [engine.generate_batch(prompts, 16) for _ in range(2 if prefix_caching else 1)]
                for got in runs:
                    same_answers(got, wanted)
                if prefix_caching:   # the repeated batch: every full block but the last token's, from the cache
                    cached = [r.metrics.cached_tokens for r in runs[1]]
                    assert cached == [(len(engine.tokenizer(p).input_ids) - 1) // 16 * 16 for p in prompts]
                    assert min(cached) > 0 if prompts[0].startswith(SHARED_SYSTEM) else max(cached) > 0
        finally:
            engine.close()


def test_bad_settings_raise_value_error(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown quantisation mode"):
        engine16.QuantizedEngine(str(tiny_model_dir), device="cpu", quant="int3")
    with pytest.raises(ValueError, match="group size must be one of"):
        engine16.QuantizedEngine(str(tiny_model_dir), device="cpu", quant="int4", group_size=48)
    # The tiny model's layers have 64 inputs: groups of 128 cannot tile them.
    with pytest.raises(ValueError, match=r"layers\.0\.qkv: int4 group size 128 does not divide the layer's 64"):
        engine16.QuantizedEngine(str(tiny_model_dir), device="cpu", quant="int4", group_size=128)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(torch.randn(8, 100), 32)
    with pytest.raises(ValueError, match="unknown quantisation mode None"):   # a QuantizedEngine is quantised
        engine16.QuantizedEngine(str(tiny_model_dir), device="cpu", quant=None)
    with pytest.raises(ValueError, match="path must be"):
        Int8Weight(torch.randn(4, 32), path="quick")
    with pytest.raises(ValueError, match="cannot read mode"):
        parse_mode("int4-q32")
    with pytest.raises(ValueError, match="unknown head format 'int3'"):
        engine16.QuantizedEngine(str(tiny_model_dir), device="cpu", quant="int8", quant_head="int3")
    # Every engine from Chapter 6 on takes the same keywords, checked the same way.
    with pytest.raises(ValueError, match="quant must be one of bf16, fp16, int8, w8a8, int4"):
        LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, quant="int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, quant="int4", group_size=48)
    assert parse_mode("int4-g64-int4head") == ("int4", 64, "int4")


def test_agreement_counts_tokens_before_the_first_divergence():
    share, identical = demo16.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert share == (2 + 4) / 8 and identical == 1


def test_perplexity_of_a_uniform_model_is_the_vocabulary(tiny_model_dir):
    """All-zero weights give equal logits for every token: perplexity must be exactly the vocab size."""
    base = LlamaModel.from_folder(tiny_model_dir)
    zeros = LlamaModel(base.config, {k: torch.zeros_like(v) for k, v in base.w.items()})
    assert demo16.perplexity(zeros, list(range(50)), window=16) == pytest.approx(base.config.vocab_size, rel=1e-4)


@pytest.mark.real_model
def test_real_model_int8_and_int4_stay_close_to_float32(default_model_dir, reference_prompts):
    """Measured on SmolLM2-135M: over the first 512 held-out tokens (one window), greedy on the 7 reference
    prompts x 16 tokens. The full table (all tokens, more modes) is `python 16_quantization.py`."""
    base = load_script("10_model_engine").ModelEngine(str(default_model_dir), device="cpu")
    ids = demo16.heldout_ids(base.tokenizer)[:513]
    float_ppl = demo16.perplexity(base.model, ids)
    reference = demo16.greedy_ids(base, reference_prompts, 16)
    for spec, ppl_tolerance in (("int8", 0.02), ("int4-g32", 0.10)):
        engine = demo16.variant(base, spec)
        ppl = demo16.perplexity(engine.model, ids)
        share, identical = demo16.agreement(reference, demo16.greedy_ids(engine, reference_prompts, 16))
        print(f"{spec}: perplexity {ppl:.3f} vs float32 {float_ppl:.3f} ({100 * (ppl / float_ppl - 1):+.2f}%), "
              f"agreement {100 * share:.0f}%, identical {identical}/{len(reference_prompts)}")
        assert abs(ppl / float_ppl - 1) < ppl_tolerance
        if spec == "int8":
            assert identical > len(reference_prompts) / 2   # most prompts: the same greedy tokens


def test_llama_cpp_anchor_refuses_clearly(tmp_path, monkeypatch):
    """llama-cpp-python is optional: without it, or without the file, the demo's flag says why."""
    anchor = load_script("16_llama_cpp")
    with pytest.raises(ValueError, match="no GGUF file"):
        anchor.LlamaCppEngine(tmp_path / "missing.gguf", None, 2)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)   # import now fails
    with pytest.raises(ValueError, match="not a dependency"):
        anchor.LlamaCppEngine(tmp_path / "model.gguf", None, 2)
    engine = object.__new__(anchor.LlamaCppEngine)   # the parameter check comes before any llama.cpp call
    with pytest.raises(ValueError, match="plain greedy"):
        engine.generate("Hi", 4, SamplingParams(temperature=0.7))


def test_ceiling_parts_run_on_every_format(tiny_model_dir):
    """16_quantization_ceiling times matmuls apart from the rest: its hollow model must skip every
    matmul (all-zero logits) yet run the same forward, for float32 and quantised weights alike."""
    ceiling = load_script("16_quantization_ceiling")
    base = LlamaModel.from_folder(tiny_model_dir)
    for model in (base, quantize(base, "int4", 32)):
        hollow = ceiling.without_matmuls(model)
        batch = RaggedBatch.build([[5, 6, 7]], [0], [0], 8)
        logits = hollow.forward(batch, hollow.new_cache(1, 8))
        assert logits.shape == (1, base.config.vocab_size) and not logits.any()
        assert model.forward(batch, model.new_cache(1, 8)).any()     # the original is untouched
        assert ceiling.matmuls_ms(model) > 0 and ceiling.step_ms(model, context=3, steps=2) > 0


def test_ceiling_flags_parts_that_add_up_to_more_than_the_whole():
    """Timed apart on a busy machine, matmuls + everything else can exceed the whole step: the
    script must say so rather than print a breakdown that cannot be one."""
    ceiling = load_script("16_quantization_ceiling")
    median = {"float32": [20.6, 3.1, 27.7], "int8": [13.0, 3.1, 17.4],     # quiet: the parts fit
              "int4 g32": [9.0, 4.5, 11.9], "int4 g64": [7.8, 3.1, 11.0]}   # 13.5 > 11.9; 10.9 is noise
    assert ceiling.parts_exceeding_the_whole(median) == ["int4 g32"]


def test_decode_rate_uses_tpot_or_takes_the_prefill_off(tiny_model_dir):
    """Batch-1 speed is decode speed: from TPOT where the engine reports it, else from a second,
    one-token request that times the prefill alone (HF generate's case)."""
    engine = load_script("10_model_engine").ModelEngine(str(tiny_model_dir), device="cpu")
    rate = demo16.decode_rate(engine, "Hello", 6)
    assert 0 < rate < float("inf")
    calls = []

    class NoTPOT:
        def generate(self, prompt, max_new_tokens, params):
            calls.append(max_new_tokens)
            result = engine.generate(prompt, max_new_tokens, params)
            result.metrics.tpot_ms = None
            return result
    assert 0 < demo16.decode_rate(NoTPOT(), "Hello", 16) < float("inf") and calls == [16, 1]


def test_the_speed_summary_says_what_a_count_of_rounds_allows():
    assert demo16.rounds_phrase(1) == "one round"
    assert demo16.rounds_phrase(2) == "the mean of 2 rounds, engines alternating"
    assert demo16.rounds_phrase(6) == "the median of 6 rounds, engines alternating"
    with pytest.raises(ValueError):
        demo16.rounds_phrase(0)


def test_replot_reads_back_the_printed_table(capsys, tmp_path):
    """--replot redraws the plot from a saved run: the printed table parses back to its rows."""
    rows = [{"name": "float32", "mb": 538.0, "b1": 31.2, "b32": 112.0, "ppl": 19.764, "agree": 1.0,
             "identical": 7, "prompts": 7},
            {"name": "int4 g32, head int4", "mb": 113.0, "b1": 108.8, "b32": 169.0, "ppl": 21.247, "agree": 0.18,
             "identical": 0, "prompts": 7},
            {"name": "HF generate (float32)", "mb": 538.0, "b1": 23.7}]
    demo16.print_table(rows)
    printed = capsys.readouterr().out
    # The token share and the whole answers are two columns, never "18% (0/7)" read as one figure.
    row = next(line for line in printed.splitlines() if line.startswith("  int4 g32, head int4"))
    assert row.split()[-4:] == ["18%", "0", "of", "7"] and "/7)" not in printed
    back = demo16.rows_from_table(printed)
    assert [(r["name"], r["b1"], r["b32"], r["ppl"]) for r in back] == [
        ("float32", 31.2, 112.0, 19.764), ("int4 g32, head int4", 108.8, 169.0, 21.247),
        ("HF generate (float32)", 23.7, None, None)]
    demo16.plot(back, str(tmp_path / "q.png"))
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        demo16.rows_from_table("no table here")


def test_int8_slices_of_split_rows_get_the_whole_rows_scale(tiny_model_dir):
    """Chapter 14's O and down are split by inputs: each rank quantises a slice of every row. With
    the slice's own scale the codes differ from one process's (and greedy tokens drifted after ~13
    of 24 on the real model at 3 ranks); with the row's scale (`row_max`, an all-reduce MAX across
    the ranks) the codes are one process's exactly, and the slices' partial sums add up to its product."""
    w = random_weight(k=192)
    w[:, 150] *= 20                       # the third slice holds each row's largest |w|
    slices = torch.chunk(w, 3, dim=1)
    row_max = lambda amax: w.abs().amax(dim=1)   # noqa: E731 - what the ranks' all-reduce MAX returns
    whole = Int8Weight(w, "reference")
    for kind in (Int8Weight, W8A8Weight):
        own = [kind(s, "reference") for s in slices]
        shared = [kind(s, "reference", row_max) for s in slices]
        assert not torch.equal(torch.cat([p.q for p in own], dim=1), whole.q)
        assert torch.equal(torch.cat([p.q for p in shared], dim=1), whole.q)
    x = torch.randn(4, 192, generator=torch.Generator().manual_seed(1))
    parts = sum(p.matmul(xs) for p, xs in zip([Int8Weight(s, "fast", row_max) for s in slices], torch.chunk(x, 3, 1)))
    assert torch.allclose(parts, x @ whole.dequantize().T, rtol=2e-2, atol=2e-2)

    class Slice:   # a row-split weight as quantize() meets it: a wrapper that knows the rows' largest |w|
        def __init__(self, wrapped, full):
            self.wrapped, self.full = wrapped, full

        def replace(self, wrapped):
            return wrapped

        def row_max(self, amax):
            return self.full.abs().amax(dim=1)

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"), [])
    name = "model.layers.0.down"
    full = model.w[name]
    k = full.shape[1] // 2
    sliced = model.with_weights({**model.w, name: Slice(full[:, :k], full)})
    got = quantize(sliced, "int8").w[name]
    assert torch.equal(got.q, Int8Weight(full).q[:, :k])
