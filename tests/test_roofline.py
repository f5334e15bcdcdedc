"""Chapter 4 (08_roofline.py, over minivllm/roofline.py): a step's bytes and FLOPs against hand
numbers, the roofline's arithmetic, and the measurements run on tiny sizes."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script
from minivllm import threads
from minivllm.model import LlamaModel
from minivllm.roofline import LLAMA3_8B, as_config, best_time, forward_flops, measure_bandwidth, measure_matmul_peak

roofline = load_script("08_roofline")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# SmolLM2-135M's config, written out (the fields the arithmetic reads)
SMOL = as_config(dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      hidden_size=576, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=8192))
SMOL_PARAMS = 134_515_008          # the model's parameter count (the tied head counted once)


def test_decode_step_cost_of_the_default_model_by_hand():
    cost = roofline.decode_step_cost(SMOL, batch=1, context=128)
    assert cost.weight_bytes == 4 * SMOL_PARAMS                        # float32, tied head read whole
    assert cost.kv_bytes == 129 * 2 * 30 * 3 * 64 * 4                    # 128 read + 1 written
    per_layer = 576 * (9 + 6) * 64 + 9 * 64 * 576 + 3 * 576 * 1536     # 3,538,944 weights in matmuls
    assert cost.flops == 2 * (30 * per_layer + 576 * 49152) + 4 * 30 * 9 * 64 * 129
    assert cost.intensity == pytest.approx(0.51, abs=0.01)             # about 2 FLOPs per 4-byte weight
    # batch 32: the weights are read once for all rows, FLOPs and KV bytes grow 32-fold
    big = roofline.decode_step_cost(SMOL, batch=32, context=128)
    assert big.weight_bytes == cost.weight_bytes and big.kv_bytes == 32 * cost.kv_bytes
    assert big.flops == 32 * cost.flops and big.intensity > 10 * cost.intensity
    # bf16 weights halve the bytes and double the intensity (nearly: the KV bytes halve too)
    half = roofline.decode_step_cost(SMOL, batch=1, context=128, dtype=torch.bfloat16)
    assert half.bytes * 2 == cost.bytes and half.intensity == pytest.approx(2 * cost.intensity)


def test_untied_embeddings_are_looked_up_not_read():
    llama = as_config(LLAMA3_8B)
    table = 128256 * 4096 * 2                                          # the input embedding, bf16
    assert roofline.weights_read(llama, torch.bfloat16, 1) == 2 * 8_030_261_248 - table + 4096 * 2
    assert roofline.weights_read(SMOL, torch.float32, 8) == 4 * SMOL_PARAMS


def test_prefill_cost_by_hand():
    cost = roofline.prefill_cost(SMOL, 100)
    assert cost.flops == forward_flops(SMOL, 100, 0)
    assert cost.kv_bytes == 100 * 46080 and cost.weight_bytes == 4 * SMOL_PARAMS
    assert cost.intensity > 40 * roofline.decode_step_cost(SMOL, 1, 100).intensity


def test_roofline_arithmetic():
    roof = roofline.Roofline(bandwidth=10e9, peak=100e9)               # ridge at 10 FLOP/byte
    assert roof.ridge == 10
    assert roof.attainable(1) == 10e9 and roof.attainable(10) == 100e9 and roof.attainable(1000) == 100e9
    memory = roofline.StepCost(flops=1e9, weight_bytes=1e9, kv_bytes=0)   # 1 FLOP/byte
    compute = roofline.StepCost(flops=1e12, weight_bytes=1e9, kv_bytes=0)
    assert roof.bound(memory) == "memory" and roof.floor_seconds(memory) == pytest.approx(0.1)
    assert roof.bound(compute) == "compute" and roof.floor_seconds(compute) == pytest.approx(10)


def test_bend_batch_is_the_first_batch_at_the_ridge():
    for ridge in (0.3, 2.5, 20, 40):
        roof = roofline.Roofline(bandwidth=1e9, peak=ridge * 1e9)
        b = roofline.bend_batch(roof, SMOL, 128)
        assert roofline.decode_step_cost(SMOL, b, 128).intensity >= ridge
        assert b == 1 or roofline.decode_step_cost(SMOL, b - 1, 128).intensity < ridge
    # at a long context the KV reads grow as fast as the FLOPs: intensity levels off below a high ridge
    assert roofline.bend_batch(roofline.Roofline(1e9, 200e9), SMOL, 8192) is None


def test_measurements_run_on_tiny_sizes():
    cpu = torch.device("cpu")
    assert measure_bandwidth(cpu, nbytes=1 << 20, repeats=2) > 1e6
    assert measure_matmul_peak(cpu, torch.float32, n=64, repeats=2) > 1e6
    assert measure_matmul_peak(cpu, torch.bfloat16, n=64, repeats=2) > 1e5


def test_steps_are_timed_on_the_decode_loop(tiny_model_dir):
    engine = load_script("07_decode_loop").DecodeLoopEngine(str(tiny_model_dir), device="cpu")
    assert roofline.step_seconds(engine, batch=3, context=12, repeats=2) > 0
    assert roofline.step_seconds(engine, batch=1, context=12, repeats=1, decode=False) > 0
    prompt = roofline.context_prompt(engine.tokenizer, 20)
    assert abs(len(engine.tokenizer(prompt).input_ids) - 20) <= 2
    assert roofline.per_token_seconds(engine.generate, prompt, 3, 1, "tiny") > 0


def test_main_predicts_and_plots(tiny_model_dir, tmp_path, monkeypatch, capsys):
    plot = tmp_path / "roof.png"
    monkeypatch.setattr("sys.argv", ["08_roofline.py", "--model", str(tiny_model_dir), "--device", "cpu",
                                     "--memory", "4MB", "--gemm-size", "64", "--repeats", "1",
                                     "--plot", str(plot)])
    roofline.main()
    out = capsys.readouterr().out
    assert "[limits]" in out and "[prediction]" in out and "-bound: " in out and "% of roof" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matmul_bound_counts_the_flops_it_times(tiny_model_dir):
    """Chapter 9's bound at the matmul peak counts exactly the FLOPs its timed matmuls do."""
    from torch.utils.flop_counter import FlopCounterMode

    bound = load_script("13_matmul_bound")
    model = LlamaModel.from_folder(tiny_model_dir)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        bound.matmuls_ms(model, tokens=5, heads=2)
    assert counter.get_total_flops() == bound.matmul_flops(model, 5, 2)


def test_measurements_in_a_log_are_plain_lines_without_carriage_returns(capsys):
    best_time(lambda: None, torch.device("cpu"), 3, label="bandwidth")
    err = capsys.readouterr().err   # captured: not a terminal, as in `python 08_roofline.py > log 2>&1`
    assert "\r" not in err and err.startswith("[measure] bandwidth: best of 3 tries") and err.count("\n") == 1


def test_the_plot_names_the_device_measured(monkeypatch):
    """A run on CUDA is labelled with the GPU's name, not the host CPU's."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(threads, "cpu_name", lambda: "AMD EPYC (test)")
    assert roofline.device_label(torch.device("cuda")) == "NVIDIA H100 80GB HBM3"
    assert roofline.device_label(torch.device("cpu")) == "AMD EPYC (test)"
