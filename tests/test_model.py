"""Chapter 6: our Llama against HF's, logits and tokens, on the tiny model and the real one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import load_script, step_by_step_logits
from kit.engines import load_engine
from minivllm.batch import RaggedBatch
from minivllm.contracts import SamplingParams
from minivllm.model import LlamaModel
from minivllm.model_runner import ModelRunner, load_model

engine10 = load_script("10_model_engine")
decode_loop = load_script("07_decode_loop")


def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def tiny_variant_dir(tmp_path_factory, default_model_dir):
    """A tiny Llama with an untied LM head and Llama-3 rope scaling: the other code paths."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("tiny-llama3")
    LlamaForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_variant_dir"])
def test_logits_match_hf_prefill_and_every_decode_step(which, request):
    folder = request.getfixturevalue(which)
    ids = list(range(5, 205, 7))                       # 29 tokens: 20 prefilled, 9 decoded
    model = LlamaModel.from_folder(folder)
    diff = (step_by_step_logits(model, ids, 20) - hf_logits(folder, ids)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.real_model
def test_real_model_logits_match_hf(default_model_dir):
    ids = list(range(100, 1100, 40))                  # 25 tokens: 17 prefilled, 8 decoded
    model = LlamaModel.from_folder(default_model_dir)
    diff = (step_by_step_logits(model, ids, 17) - hf_logits(default_model_dir, ids)).abs().max().item()
    assert diff <= 1e-4


def test_ragged_batch_equals_each_sequence_alone(tiny_model_dir):
    model = LlamaModel.from_folder(tiny_model_dir)
    a, b, c = list(range(10, 40)), list(range(50, 57)), list(range(70, 71))
    alone = [step_by_step_logits(model, s, len(s))[-1] for s in (a, b, c)]
    # Mixed batch: a is mid-prefill (its first 12 tokens cached), b decodes its last
    # token, c is a fresh one-token prefill, all in one forward, rows out of order.
    cache = model.new_cache(3, 64)
    model.forward(RaggedBatch.build([a[:12]], [2], [0], 64), cache)
    model.forward(RaggedBatch.build([b[:-1]], [0], [0], 64), cache)
    mixed = model.forward(RaggedBatch.build([a[12:], b[-1:], c], [2, 0, 1], [12, len(b) - 1, 0], 64), cache)
    for got, want in zip(mixed, alone):
        assert (got - want).abs().max().item() <= 1e-5


def test_kv_cache_bytes_match_the_formula(tiny_model_dir):
    model = LlamaModel.from_folder(tiny_model_dir)
    c = model.config
    assert c.kv_bytes_per_token(torch.float32) == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert model.new_cache(3, 10).nbytes == 30 * c.kv_bytes_per_token(torch.float32)


def broken_copy(src, tmp_path, edit_config=None, edit_tensors=None):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    if edit_config:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_unknown_model_type_is_refused(tiny_model_dir, tmp_path):
    folder = broken_copy(tiny_model_dir, tmp_path, edit_config=lambda c: c.update(model_type="mamba"))
    with pytest.raises(ValueError, match="model_type 'mamba' is not implemented"):
        LlamaModel.from_folder(folder)


def test_missing_tensor_is_refused(tiny_model_dir, tmp_path):
    folder = broken_copy(tiny_model_dir, tmp_path,
                         edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        LlamaModel.from_folder(folder)


def test_wrong_shape_is_refused(tiny_model_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].clone()
    folder = broken_copy(tiny_model_dir, tmp_path, edit_tensors=shrink)
    with pytest.raises(ValueError, match="k_proj.weight' has shape"):
        LlamaModel.from_folder(folder)


@pytest.fixture(scope="module")
def tiny_model_engine(tiny_model_dir):
    return engine10.ModelEngine(str(tiny_model_dir), device="cpu")


def test_greedy_equals_baseline_on_reference_prompts(tiny_model_engine, tiny_engine, reference_prompts):
    for prompt in reference_prompts:
        assert tiny_model_engine.generate(prompt, 12).output_ids == tiny_engine.generate(prompt, 12).output_ids


def test_generate_batch_is_a_real_batch_with_the_same_answers(tiny_model_engine, tiny_engine, reference_prompts):
    params = SamplingParams(stop=("the",))
    batch = tiny_model_engine.generate_batch(reference_prompts, 10, params)
    for prompt, got in zip(reference_prompts, batch):
        want = tiny_engine.generate(prompt, 10, params)
        assert (got.output_ids, got.text, got.finish_reason) == (want.output_ids, want.text, want.finish_reason)
        assert got.metrics.ttft_ms is not None


def test_seeded_sampling_equals_decode_loop_engine(tiny_model_engine, tiny_model_dir, reference_prompts):
    loop = decode_loop.DecodeLoopEngine(str(tiny_model_dir), device="cpu")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11)
    for prompt in reference_prompts[:3]:
        ours = tiny_model_engine.generate(prompt, 10, params).output_ids
        assert ours == loop.generate(prompt, 10, params).output_ids
        assert ours == tiny_model_engine.generate(prompt, 10, params).output_ids   # reproducible


def test_run_steps_the_live_requests_and_drops_finished_ones(tiny_model_engine, monkeypatch):
    """run(requests) yields one list of text pieces per step, "" for a request that is done; a finished
    request leaves the batch at once: nobody computes tokens it does not want."""
    engine, params = tiny_model_engine, SamplingParams(ignore_eos=True)
    requests = [engine.new_request("Hello", 2, params), engine.new_request("The capital of France is", 4, params)]
    rows, forward = [], engine.model.forward
    monkeypatch.setattr(engine.model, "forward",
                        lambda batch, *a, **k: rows.append(batch.lengths) or forward(batch, *a, **k))
    steps = list(engine.run(requests))
    assert len(steps) == 4 and all(len(s) == 2 for s in steps) and steps[2][0] == steps[3][0] == ""
    assert rows == [[r.n_prompt for r in requests], [1, 1], [1], [1]]
    assert ["".join(s[i] for s in steps) for i in range(2)] == [engine.output.result(r).text for r in requests]
    assert [len(r.new_ids) for r in requests] == [2, 4] and all(r.num_computed == r.num_tokens - 1 for r in requests)


def test_batch_chunks_fit_kv_memory_and_max_num_seqs(tiny_model_dir, tiny_engine, reference_prompts):
    per_token = 2 * 2 * 2 * 16 * 4                   # the tiny model's K/V bytes per token, float32
    kv_memory = 2 * 140 * per_token
    engine = engine10.ModelEngine(str(tiny_model_dir), device="cpu", max_num_seqs=3, kv_memory=kv_memory)
    requests = [engine.new_request(p, 10) for p in reference_prompts]
    chunks = list(engine.batch_chunks(requests))
    assert chunks[0].start == 0 and chunks[-1].stop == len(requests)
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))          # consecutive, none skipped
    for c in chunks:   # each row sized for its longest member; a request alone always gets its chance
        n = c.stop - c.start
        assert n <= 3 and (n == 1 or n * max(r.n_prompt + r.budget for r in requests[c]) * per_token <= kv_memory)
    assert len(chunks) >= 3
    got = engine.generate_batch(reference_prompts, 10)
    assert [r.output_ids for r in got] == [tiny_engine.generate(p, 10).output_ids for p in reference_prompts]


def test_stream_pieces_add_up_to_the_result(tiny_model_engine, reference_prompts):
    *pieces, result = tiny_model_engine.generate_stream(reference_prompts[0], 16)
    assert "".join(pieces) == result.text and result.metrics.output_tokens == len(result.output_ids)


def test_bad_input_is_a_value_error(tiny_model_engine):
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_model_engine.generate("hello " * 600, 8)
    with pytest.raises(ValueError, match="prompts must be a list"):
        tiny_model_engine.generate_batch("hello", 8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_num_seqs"):
            engine10.ModelEngine(None, max_num_seqs=bad)
    with pytest.raises(ValueError, match="kv_memory"):
        engine10.ModelEngine(None, kv_memory=0)


def test_max_batch_size_is_max_num_seqs_read_only(tiny_model_dir):
    engine = engine10.ModelEngine(str(tiny_model_dir), device="cpu", max_num_seqs=3)
    assert engine.max_batch_size == engine.max_num_seqs == 3 == engine.features()["max_num_seqs"] \
        == engine.capabilities().max_batch_size   # what the server batches a list by
    with pytest.raises(AttributeError):
        engine.max_batch_size = 5
    assert engine.model is engine.runner.model and engine.features()["quant"] == "float32"


def test_engine_spec_loads_through_10_model(tiny_model_dir):
    engine = load_engine("10_model_engine:ModelEngine", str(tiny_model_dir), device="cpu")
    assert type(engine) is engine10.ModelEngine


def test_model_runner_steps_a_chunked_prefill_next_to_decodes(tiny_model_engine):
    """One runner step is prepare -> forward -> sample over any mix: a prompt chunk that ends mid-prompt
    predicts nothing (None); the chunk that completes it and a decode step each give the token alone would."""
    model = load_model(tiny_model_engine.folder)
    runner = ModelRunner(model, model.new_cache(2, 64))
    params = SamplingParams(ignore_eos=True)
    a, b = (tiny_model_engine.output.new_request(ids, params, 4) for ids in (list(range(10, 40)), list(range(50, 57))))
    alone = lambda ids: int(step_by_step_logits(model, ids, len(ids))[-1].argmax())   # noqa: E731
    batch = runner.prepare([a, b], [0, 0], [12, 7], [1, 0])
    assert batch.positions.tolist() == list(range(12)) + list(range(7))
    assert batch.slots.tolist() == [64 + t for t in range(12)] + list(range(7))       # row * max_len + position
    assert batch.token_ids.tolist() == a.prompt_ids[:12] + b.prompt_ids
    first = runner.step([a, b], [0, 0], [12, 7], [1, 0])
    assert first[0] is None and first[1] == alone(b.prompt_ids)
    tiny_model_engine.output.accept(b, first[1], 0.0)
    second = runner.step([a, b], [12, 7], [18, 1], [1, 0])            # a's rest of the prompt, b's decode step
    assert second == [alone(a.prompt_ids), alone(b.prompt_ids + [first[1]])]


@pytest.mark.real_model
def test_real_model_greedy_equals_baseline(real_engine, default_model_dir, reference_prompts):
    ours = engine10.ModelEngine(str(default_model_dir), device="cpu")
    batch = ours.generate_batch(reference_prompts, 24)
    for prompt, got in zip(reference_prompts, batch):
        want = real_engine.generate(prompt, 24)
        assert got.output_ids == want.output_ids
        assert ours.generate(prompt, 24).output_ids == want.output_ids


def test_profile_parts_add_up_and_floors_scale_with_the_batch(tiny_model_dir, tmp_path, capsys):
    """10_profile: the parts of a step (overhead is the remainder) add up to the step, the bandwidth floor
    is the same at every batch size, the FLOP floor grows with the rows, and the plot is written."""
    profile = load_script("10_profile")
    engine = engine10.ModelEngine(str(tiny_model_dir), device="cpu")
    table = profile.profile_decode(engine.model, engine.tokenizer, batch_sizes=(1, 3), steps=2)
    assert table["bandwidth"] > 0 and table["flops"] > 0 and table["weight_bytes"] == engine.model.weight_bytes
    for rows in table["rows"].values():
        assert sum(rows[p] for p in profile.PARTS) == pytest.approx(rows["total"], rel=1e-6)
        assert all(rows[p] >= 0 for p in profile.PARTS)
    one, three = table["rows"][1], table["rows"][3]
    assert one["floor_bandwidth"] == three["floor_bandwidth"]
    assert three["floor_flops"] == pytest.approx(3 * one["floor_flops"])
    profile.print_profile(table)
    assert "of the tighter floor" in capsys.readouterr().out
    profile.plot_profile(table, str(tmp_path / "profile.png"))
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layouts_time_both_layouts_of_every_layer_matrix(tiny_model_dir, capsys):
    """10_profile --layouts: one row per batch size, a positive time for each layout, printed."""
    profile = load_script("10_profile")
    model = engine10.ModelEngine(str(tiny_model_dir), device="cpu").model
    table = profile.time_layouts(model, batch_sizes=(1, 4), rounds=2)
    assert list(table) == [1, 4]
    assert all(row > 0 and col > 0 for row, col in table.values())
    profile.print_layouts(table)
    assert "input-major" in capsys.readouterr().out
