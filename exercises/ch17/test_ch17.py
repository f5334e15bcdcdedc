"""Chapter 17's exercises, on the real adapter reader, the real engine and SmolLM2's config."""

import json

import pytest
import torch
from safetensors.torch import save_file

from harness import catches, patched, within
from minivllm.lora import read_adapter
from minivllm.model import ModelConfig

LAYER = "base_model.model.model.layers.0.self_attn.q_proj"


def test_17_1_adapter_size(answers, default_model_dir):
    from minivllm.lora import module_sizes

    config = ModelConfig.from_folder(default_model_dir)
    measured = 8 * config.num_layers * sum(i + o for i, o in module_sizes(config).values())
    within(answers.ADAPTER_PARAMS, measured, rel=0.01, what="ADAPTER_PARAMS")


def one_adapter(folder, config: ModelConfig, **settings):
    fan_in = fan_out = config.hidden_size   # q_proj: hidden -> heads x head_dim, the same here
    torch.manual_seed(0)
    folder.mkdir()
    save_file({f"{LAYER}.lora_A.weight": torch.randn(16, fan_in),
               f"{LAYER}.lora_B.weight": torch.randn(fan_out, 16)}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"], **settings}))
    return read_adapter(folder, config, 16)[(0, "q_proj")]


def test_17_2_rslora_scale(answers, tiny_model_dir, tmp_path):
    config = ModelConfig.from_folder(tiny_model_dir)
    _, plain = one_adapter(tmp_path / "plain", config)
    _, rs = one_adapter(tmp_path / "rs", config, use_rslora=True)
    within(answers.RSLORA_OVER_PLAIN, float(rs.norm() / plain.norm()), rel=1e-3, what="RSLORA_OVER_PLAIN")


def test_17_3_lora_delta(answers):
    torch.manual_seed(1)
    slots_n, rank, fan_in, fan_out, tokens = 3, 4, 32, 24, 40
    a, b = torch.randn(slots_n, rank, fan_in), torch.randn(slots_n, fan_out, rank)
    x, slots = torch.randn(tokens, fan_in), torch.randint(-1, slots_n, (tokens,))
    slots[:3] = -1
    got = answers.lora_delta(x, slots, a, b)
    assert got.shape == (tokens, fan_out), f"shape {tuple(got.shape)}, expected {(tokens, fan_out)}"
    for t in range(tokens):
        s = int(slots[t])
        expected = torch.zeros(fan_out) if s < 0 else b[s] @ (a[s] @ x[t])
        assert torch.allclose(got[t], expected, atol=1e-4), f"token {t} (slot {s}) is wrong"
        if s < 0:
            assert not got[t].any(), f"token {t} is a base row: its update must be exactly zero"


# --- the planted defect (read it after you have tried) ---------------------------------------
@pytest.fixture(scope="module")
def case(tiny_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from minivllm import LLM, LoRARequest

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("ch17-adapter")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                     init_lora_weights=False)).save_pretrained(folder)
    llm = LLM(str(tiny_model_dir), device="cpu", kv_memory=2 << 20, enable_lora=True, max_lora_rank=8,
              prefix_caching=True)
    yield llm, "The quick brown fox jumps over the lazy dog. " * 6, LoRARequest("ch17", 1, str(folder))
    llm.close()


def salt_forgets_the_adapter(original):
    return property(lambda self: self.params.cache_salt)   # blocks keyed by the tokens alone


def test_17_4_find_the_bug(answers, case):
    catches(answers.check_adapters_keep_their_blocks,
            lambda: patched("minivllm.output:Request.cache_salt", salt_forgets_the_adapter), lambda: case,
            what="check_adapters_keep_their_blocks")
