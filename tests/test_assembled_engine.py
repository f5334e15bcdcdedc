"""The assembled engine through the server: Chapter 9's engine with Chapter 12's weights and
Chapter 8's prefix cache answers 16 concurrent clients exactly as Chapter 12's engine answers
each of them alone (greedy, token for token)."""

from __future__ import annotations

import asyncio
import importlib

import httpx
import pytest

from conftest import load_script
from minivllm import LLM
from minivllm.contracts import SamplingParams

server = load_script("05_server")
quant_engines = load_script("16_quantization_engine")
engines = importlib.import_module("kit.engines")

SYSTEM = "You are a careful assistant. Answer briefly and stay on topic. " * 3   # shared: a prefix cache hit


def prompts(reference_prompts: list[str]) -> list[str]:
    """16 prompts: the reference prompts alone, and behind one shared system text."""
    return [*reference_prompts, *(SYSTEM + p for p in reference_prompts)][:16]


@pytest.fixture(scope="module")
def alone(tiny_model_dir, reference_prompts):
    """Chapter 12's engine, one request at a time: the answers to match."""
    answers = {}
    for quant in ("int8", "int4"):
        engine = quant_engines.QuantizedEngine(str(tiny_model_dir), device="cpu", quant=quant, group_size=32)
        answers[quant] = [engine.generate(p, 12, SamplingParams(ignore_eos=True)).output_ids
                          for p in prompts(reference_prompts)]
    return answers


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_16_concurrent_clients_get_chapter_12s_answers(tiny_model_dir, reference_prompts, alone, quant, prefix_caching):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=2 << 20, quant=quant,
                 group_size=32, prefix_caching=prefix_caching, max_num_batched_tokens=64)
    app = server.make_app(engine)
    texts = prompts(reference_prompts)

    async def clients():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            bodies = [{"prompt": p, "max_tokens": 12, "ignore_eos": True, "logprobs": 0} for p in texts]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    try:
        responses = asyncio.run(clients())
        for response, expected in zip(responses, alone[quant]):
            assert response.status_code == 200, response.text
            tokens = response.json()["choices"][0]["logprobs"]["tokens"]
            assert tokens == [engine.tokenizer.decode([t]) for t in expected]
        usage = [r.json()["usage"] for r in responses]
        cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usage)
        assert (cached > 0) == prefix_caching, usage     # the shared system text came from the cache
        assert engine.features()["quant"].startswith(quant) and engine.features()["prefix_caching"] == prefix_caching
    finally:
        engine.close()


def test_options_are_checked_before_loading(tmp_path):
    """Every option is checked before any weights are looked for: a folder with no model is never read."""
    for options, message in (({"quant": "int3"}, "quant must be one of"), ({"group_size": 48}, "group_size must be"),
                             ({"block_size": 0}, "block_size must be"), ({"speculative": "magic"}, "speculative must"),
                             ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "must be >= max_num_seqs"),
                             ({"tensor_parallel_size": 0}, "tensor_parallel_size must be")):
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path / "no-model-here"), device="cpu", **options)
    with pytest.raises(ValueError, match="cannot load"):
        engines.load_object("no_such_module:thing")


def test_reset_forgets_the_cache_the_scheduler_uses(tiny_model_dir, reference_prompts):
    engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=2 << 20, prefix_caching=True)
    try:
        prompt = SYSTEM + reference_prompts[0]
        engine.generate(prompt, 4)
        assert engine.generate(prompt, 4).metrics.cached_tokens > 0
        engine.reset_prefix_cache()
        assert engine.scheduler.blocks is engine.blocks and not engine.blocks.content
        assert engine.generate(prompt, 4).metrics.cached_tokens == 0     # cold again
    finally:
        engine.close()
