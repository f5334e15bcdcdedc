"""Chapter 17, served and stacked: adapters loaded and unloaded while the server runs (vLLM's
runtime routes), for the admin key only and only from --lora-dir; what a refused batch held is let
go; an adapter on a quantised or compiled base gives what it gives on the plain one."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import load_script
from kit import server_ops
from minivllm import LLM, LoRARequest
from minivllm.contracts import SamplingParams
from test_lora import make_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADMIN, TENANT = {"Authorization": "Bearer admin-key"}, {"Authorization": "Bearer tenant-key"}


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("first", 11), ("second", 12), ("third", 13)):
        make_adapter(tiny_model_dir, root / name, seed)
    (tmp_path_factory.mktemp("elsewhere") / "secret").mkdir()
    return root


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", kv_memory=4 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_cpu_loras=2)
    yield llm
    llm.close()


def test_a_refused_batch_lets_go_of_its_adapters(engine, lora_dir):
    lora = LoRARequest("first", 1, str(lora_dir / "first"))
    with pytest.raises(ValueError):   # the second prompt is refused: the first never runs
        engine.generate(["fine", ""], SamplingParams(max_tokens=4), lora_request=lora)
    assert not engine.lora.in_use
    engine.generate("fine", SamplingParams(max_tokens=4), lora_request=lora)
    assert not engine.lora.in_use     # and one that ran let go as it left
    engine.remove_lora(1)


def test_runtime_routes_need_the_admin_key_and_a_folder(engine, lora_dir):
    server = load_script("05_server")
    with pytest.raises(ValueError, match="--admin-key"):
        server.make_app(engine, "base", ops=server_ops.ServerOps(api_key="tenant-key"), lora_dir=str(lora_dir))
    with pytest.raises(ValueError, match="not a folder"):
        server.make_app(engine, "base", ops=server_ops.ServerOps(admin_key="admin-key"),
                        lora_dir=str(lora_dir / "none"))


def test_load_and_unload_while_serving(engine, lora_dir, tmp_path_factory):
    server = load_script("05_server")
    ops = server_ops.ServerOps(api_key="tenant-key", admin_key="admin-key")
    app = server.make_app(engine, "base", ops=ops, lora_dir=str(lora_dir))
    outside = str(lora_dir.parent)

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            def load(body, headers=ADMIN):
                return client.post("/v1/load_lora_adapter", json=body, headers=headers)

            def unload(name, headers=ADMIN):
                return client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers)

            def complete(model, n=8):
                return client.post("/v1/completions", headers=TENANT, json={
                    "model": model, "prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True})

            got = {"tenant": await load({"lora_name": "x", "lora_path": "first"}, TENANT),
                   "no key": await load({"lora_name": "x", "lora_path": "first"}, {}),
                   "dotdot": await load({"lora_name": "x", "lora_path": "../elsewhere/secret"}),
                   "absolute": await load({"lora_name": "x", "lora_path": outside}),
                   "missing": await load({"lora_name": "x", "lora_path": "nope"}),
                   "extra field": await load({"lora_name": "x", "lora_path": "first", "base_model_name": "b"}),
                   "base name": await load({"lora_name": "base", "lora_path": "first"}),
                   "before": await complete("tuned"),
                   "load": await load({"lora_name": "tuned", "lora_path": "first"}),
                   "twice": await load({"lora_name": "tuned", "lora_path": "first"}),
                   "second": await load({"lora_name": "other", "lora_path": str(lora_dir / "second")}),
                   "over the cap": await load({"lora_name": "more", "lora_path": "third"})}
            got["models"] = await client.get("/v1/models", headers=TENANT)
            got["base"], got["tuned"] = await complete("base"), await complete("tuned")
            # under traffic: requests that started with the adapter finish with it
            running = [asyncio.create_task(complete("tuned", 48)) for _ in range(4)]
            for _ in range(2000):
                if engine.lora.in_use:
                    break
                await asyncio.sleep(0.005)
            got["unload"] = await unload("tuned")
            got["running"] = await asyncio.gather(*running)
            got["after"], got["again"] = await complete("tuned"), await unload("tuned")
            got["tenant unload"] = await unload("other", TENANT)
            return got

    got = asyncio.run(calls())
    assert got["tenant"].status_code == 401 and got["no key"].status_code == 401
    assert got["dotdot"].status_code == 400 and "--lora-dir" in got["dotdot"].json()["error"]["message"]
    assert got["absolute"].status_code == 400
    assert got["missing"].status_code == 404
    assert got["extra field"].status_code == 400 and got["base name"].status_code == 400
    assert got["before"].status_code == 404
    assert got["load"].status_code == 200 and "added successfully" in got["load"].text
    assert got["twice"].status_code == 400 and got["second"].status_code == 200
    assert got["over the cap"].status_code == 400 and "max_cpu_loras" in got["over the cap"].text
    assert {m["id"] for m in got["models"].json()["data"]} == {"base", "tuned", "other"}
    assert got["tuned"].status_code == 200
    assert got["tuned"].json()["choices"][0]["text"] != got["base"].json()["choices"][0]["text"]
    assert got["unload"].status_code == 200
    assert [r.status_code for r in got["running"]] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in got["running"])
    assert got["after"].status_code == 404 and got["again"].status_code == 404
    assert got["tenant unload"].status_code == 401
    assert not engine.lora.in_use
    assert "/v1/load_lora_adapter" in app.openapi()["paths"]


def answers(model_dir, lora, **options):
    """Base, adapter, and both mixed in one batch, greedy, on an engine built with these options."""
    params, prompts = SamplingParams(max_tokens=8, ignore_eos=True), ["Once upon a time", "The sky is", "def f(x):"]
    with LLM(str(model_dir), device="cpu", enable_lora=True, max_lora_rank=8, kv_memory=2 << 20, **options) as llm:
        base = [r.output_ids for r in llm.generate(prompts, params)]
        tuned = [r.output_ids for r in llm.generate(prompts, params, lora_request=lora)]
        mixed = [r.output_ids for r in llm.generate(prompts, params, lora_request=[lora, None, lora])]
    return base, tuned, mixed


@pytest.mark.parametrize("quant", ["int8", "int4", "w8a8"])
def test_an_adapter_rides_a_quantised_base(tiny_model_dir, lora_dir, quant):
    """QLoRA's serving: the adapter in float beside int8/int4 weights, mixed with base rows."""
    base, tuned, mixed = answers(tiny_model_dir, LoRARequest("first", 1, str(lora_dir / "first")), quant=quant)
    assert tuned != base
    assert mixed == [tuned[0], base[1], tuned[2]]


def test_an_adapter_rides_the_compiled_base(tiny_model_dir, lora_dir):
    """Chapter 13's packed weights and fused glue, the adapter's shrink and expand beside them."""
    lora = LoRARequest("first", 1, str(lora_dir / "first"))
    assert answers(tiny_model_dir, lora, compile=True) == answers(tiny_model_dir, lora)
