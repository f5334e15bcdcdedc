"""Chapter 17: LoRA adapters beside the base weights, per request, in one batch.

Adapters are made here with peft on the tiny model (random A and B: peft's own init leaves B
at zero, and an adapter that changes nothing would prove nothing). Each adapter's greedy tokens
must equal HF's model with that adapter merged (merge_and_unload), float32; a batch that mixes
adapters and the base must give each request what it gets alone; the prefix cache must never
hand one adapter's blocks to another.
"""

from __future__ import annotations

import json

import pytest

from kit import adapter_routes
import torch

from minivllm import LLM, LoRARequest
from minivllm.contracts import SamplingParams
from minivllm.lora import LoRA, plan_step, read_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, out, seed: int, **config):
    """A peft LoRA adapter with random A and B, saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL_SEVEN, "init_lora_weights": False,
                         "lora_dropout": 0.0, **config})
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():   # peft's random init is small beside the tiny model's weights: make it matter
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    return peft_model


def merged_greedy(peft_model, tokenizer, prompts: list[str], n: int) -> list[list[int]]:
    merged = peft_model.merge_and_unload().eval()
    outs = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        with torch.no_grad():
            got = merged.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        outs.append(got[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory, reference_prompts):
    """Two adapters (all seven modules; q and v only with rsLoRA and a rank pattern) and HF's
    merged answers for each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    made = {}
    for name, seed, config in (("all7", 1, {}),
                               ("qv", 2, {"target_modules": ["q_proj", "v_proj"], "use_rslora": True,
                                          "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"v_proj": 4}})):
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        peft_model = make_adapter(tiny_model_dir, folder, seed, **config)
        made[name] = (folder, merged_greedy(peft_model, tokenizer, reference_prompts, GREEDY.max_tokens))
    return made


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", kv_memory=4 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8, prefix_caching=True)
    yield llm
    llm.close()


def requests_of(adapters) -> dict:
    return {name: LoRARequest(name, i + 1, str(folder)) for i, (name, (folder, _)) in enumerate(adapters.items())}


def test_each_adapter_matches_hf_merged_and_differs_from_the_base(engine, adapters, reference_prompts):
    base = [r.output_ids for r in engine.generate(reference_prompts, GREEDY)]
    for name, req in requests_of(adapters).items():
        got = [r.output_ids for r in engine.generate(reference_prompts, GREEDY, lora_request=req)]
        expected = adapters[name][1]
        mismatched = sum(g != e for g, e in zip(got, expected))
        assert mismatched <= 1, (name, got, expected)
        assert got != base, f"adapter {name} changed nothing"


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(engine, adapters, reference_prompts):
    reqs = list(requests_of(adapters).values())
    prompts = reference_prompts[:6]
    loras = [reqs[0], None, reqs[1], reqs[1], None, reqs[0]]
    alone = [engine.generate(p, GREEDY, lora_request=lora).output_ids for p, lora in zip(prompts, loras)]
    engine.reset_prefix_cache()
    mixed = [r.output_ids for r in engine.generate(prompts, GREEDY, lora_request=loras)]
    assert mixed == alone


def test_the_prefix_cache_never_shares_blocks_across_adapters(engine, adapters, reference_prompts):
    req = requests_of(adapters)["all7"]
    prompt = reference_prompts[3]               # the long passage: several full blocks
    engine.reset_prefix_cache()
    base = engine.generate(prompt, GREEDY)
    tuned = engine.generate(prompt, GREEDY, lora_request=req)
    assert tuned.metrics.cached_tokens == 0     # the base's blocks hold the base's keys, not the adapter's
    again = engine.generate(prompt, GREEDY, lora_request=req)
    assert again.metrics.cached_tokens > 0 and again.output_ids == tuned.output_ids
    assert base.output_ids != tuned.output_ids


def test_more_adapters_than_slots_swap_in_least_recently_used(tiny_model_dir, adapters, reference_prompts, tmp_path):
    third = tmp_path / "third"
    make_adapter(tiny_model_dir, third, 3, r=8, lora_alpha=16)
    reqs = [*requests_of(adapters).values(), LoRARequest("third", 3, str(third))]
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=2 << 20, enable_lora=True, max_loras=1,
             max_cpu_loras=3) as llm:
        alone = [llm.generate(reference_prompts[0], GREEDY, lora_request=r).output_ids for r in reqs]
        assert llm.lora.num_swaps == 3
        # one slot, three adapters and the base in one batch: the scheduler runs one adapter at a
        # time beside the base rows, each taking over the slot in turn
        mixed = llm.generate([reference_prompts[0]] * 4, GREEDY, lora_request=[*reqs, None])
        assert [r.output_ids for r in mixed[:3]] == alone
        assert mixed[3].output_ids == llm.generate(reference_prompts[0], GREEDY).output_ids
        assert len({tuple(a) for a in alone}) == 3


def test_refusals_at_load_say_why(tiny_model_dir, adapters, tmp_path):
    config = json.loads((adapters["all7"][0] / "adapter_config.json").read_text())
    model_config = __import__("minivllm.model", fromlist=["ModelConfig"]).ModelConfig.from_folder(tiny_model_dir)
    folder = adapters["all7"][0]
    with pytest.raises(ValueError, match="above max_lora_rank=2"):
        read_adapter(folder, model_config, 2)
    for change, why in (({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias"),
                        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                        ({"layers_to_transform": [0]}, "layers_to_transform")):
        bad = tmp_path / why
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        (bad / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=why):
            read_adapter(bad, model_config, 8)
    with pytest.raises(ValueError, match="not a peft adapter"):
        read_adapter(tmp_path, model_config, 8)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(folder))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20).new_request("hi", 2, None, None,
                                                                             LoRARequest("x", 1, str(folder)))
    with pytest.raises(ValueError, match="enable_lora does not combine with speculative: .* without each request's adapter"):
        LLM(str(tiny_model_dir), device="cpu", enable_lora=True, speculative="ngram")
    with pytest.raises(ValueError, match="max_loras"):
        LoRA(max_loras=0)


def test_a_step_plan_groups_rows_by_slot_and_skips_the_base():
    assert plan_step([None, None], [3, 1], "cpu") is None
    plan = plan_step([1, None, 0, 1], [2, 1, 1, 3], "cpu")
    assert plan.slots.tolist() == [1, 0]
    assert plan.gather.tolist() == [[0, 1, 4, 5, 6], [3, 0, 0, 0, 0]]
    assert plan.tokens.tolist() == [0, 1, 4, 5, 6, 3]


def test_the_server_serves_an_adapter_as_a_model_name(engine, adapters, reference_prompts):
    import asyncio

    import httpx

    from conftest import load_script

    server = load_script("05_server")
    adapter_routes.add_lora_modules(engine, [f"tuned={adapters['all7'][0]}"])
    app = server.make_app(engine, model_name="base")
    expected = engine.generate(reference_prompts[0], GREEDY, lora_request=next(
        a for a in engine.list_loras() if a.lora_name == "tuned")).output_ids

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            models = await client.get("/v1/models")
            body = {"prompt": reference_prompts[0], "max_tokens": 10, "ignore_eos": True, "logprobs": 0}
            tuned = await client.post("/v1/completions", json={**body, "model": "tuned"})
            base = await client.post("/v1/completions", json={**body, "model": "base"})
            unknown = await client.post("/v1/completions", json={**body, "model": "nope"})
            return models, tuned, base, unknown

    models, tuned, base, unknown = asyncio.run(calls())
    ids = [m["id"] for m in models.json()["data"]]
    assert ids[0] == "base" and "tuned" in ids
    assert tuned.status_code == 200, tuned.text
    assert tuned.json()["choices"][0]["logprobs"]["tokens"] == [engine.tokenizer.decode([t]) for t in expected]
    assert base.json()["choices"][0]["text"] != tuned.json()["choices"][0]["text"]
    assert unknown.status_code == 404
    with pytest.raises(ValueError, match="NAME=PATH"):
        adapter_routes.add_lora_modules(engine, ["no-equals-sign"])


MIXED = [0, None, 1]      # two adapters and the base; a CUDA graph's decode steps pad 3 rows to 4
SHORT = SamplingParams(max_tokens=8, ignore_eos=True)


def mixed_batch(engine, adapters, prompts):
    reqs = list(requests_of(adapters).values())
    loras = [None if i is None else reqs[i] for i in MIXED]
    return [r.output_ids for r in engine.generate(prompts[:len(loras)], SHORT, lora_request=loras)]


def test_the_graph_path_reads_each_rows_slot_from_a_static_buffer(tiny_model_dir, engine, adapters,
                                                                  reference_prompts, monkeypatch):
    """CUDA graphs (Chapter 15) stay on with adapters: on the CPU the same padded, static-buffer
    path runs eagerly, each row's slot and on/off read from the buffers a graph would record."""
    from minivllm.config import EngineConfig
    from minivllm.cuda_graphs import CUDAGraphRunner
    from minivllm.llm import decode_graphs
    from minivllm.lora import LoRAGraphRunner, RowPlan

    assert decode_graphs(EngineConfig(enable_lora=True), torch.device("cuda"), 512) is not None   # on by default

    expected = mixed_batch(engine, adapters, reference_prompts)
    steps = []
    fill = LoRAGraphRunner.fill
    monkeypatch.setattr(LoRAGraphRunner, "fill", lambda self, *a: steps.append(fill(self, *a)) or steps[-1])
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=4 << 20, enable_lora=True, max_loras=2,
             max_lora_rank=8, enforce_eager=False, max_num_seqs=8) as graphs:
        assert isinstance(graphs.runner, CUDAGraphRunner)
        assert mixed_batch(graphs, adapters, reference_prompts) == expected
        assert isinstance(graphs.lora.plan, RowPlan)
    assert steps.count(4) >= SHORT.max_tokens - 1, steps      # the decode steps took the padded path


@pytest.mark.parametrize("size", [2, 4])   # 4 ranks outnumber the 2 KV heads: each KV head's B rows go to two
def test_each_ranks_share_of_an_adapter_makes_its_share_of_the_delta(tiny_model_dir, adapters, size):
    """Beside a column-split weight a rank's A and B make exactly the rank's columns of the delta;
    beside a row-split one the ranks' partial deltas add up to the whole delta."""
    from minivllm.model import ModelConfig
    from minivllm.parallel import Shard

    whole = ModelConfig.from_folder(tiny_model_dir)
    weights = read_adapter(adapters["all7"][0], whole, 8)
    torch.manual_seed(0)
    partial = {"o_proj": 0, "down_proj": 0}
    inputs = {m: torch.randn(3, weights[(0, m)][0].shape[1]) for m in ALL_SEVEN}
    for rank in range(size):
        lora, shard = LoRA(max_lora_rank=8), Shard(rank, size, None)
        lora.split_as(shard)
        lora.whole = whole
        for module in ALL_SEVEN:
            a, b = weights[(0, module)]
            x, (la, lb), index = inputs[module], lora.local(module, a, b), shard.part(f"{module}.weight", whole)
            if module in partial:
                partial[module] = partial[module] + x[:, index[1]] @ la.T @ lb.T
            else:
                torch.testing.assert_close(x @ la.T @ lb.T, (x @ a.T @ b.T)[:, index[0]])
    for module, summed in partial.items():
        a, b = weights[(0, module)]
        torch.testing.assert_close(summed, inputs[module] @ a.T @ b.T)
