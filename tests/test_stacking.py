"""Features that stack: a weight format, compiled steps and tensor parallelism are steps of
loading the model, so each combination is token-exact against its one-process counterpart, and
`close()` leaves no process behind. Each tensor-parallel case runs in a process of its own (a
process holds one torch.distributed group)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from conftest import REPO_ROOT, run_child
from kit.workloads import reference_prompts

PROMPTS = reference_prompts()[:4]

CHILD = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    sys.path[:0] = [{root!r}]

    def children():   # every process whose parent is this one: workers and their resource tracker
        mine = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                mine += [int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()]
            except OSError:
                pass
        return sum(mine)

    from minivllm import LLM, SamplingParams
    options, prompts = json.loads({options!r}), json.loads({prompts!r})
    params = SamplingParams(ignore_eos=True)
    with LLM({model!r}, device="cpu", kv_memory=8 << 20, **options) as one:
        expected = [r.output_ids for r in one.generate_batch(prompts, 12, params)]
    group = LLM({model!r}, device="cpu", kv_memory=8 << 20, tensor_parallel_size=2, **options)
    workers = children()
    got = [r.output_ids for r in group.generate_batch(prompts, 12, params)]
    quant = group.features()["quant"]
    group.close()
    time.sleep(0.5)
    print("RESULT", json.dumps({{"same": got == expected, "workers": workers, "quant": quant,
                                 "left": children()}}))
""")


@pytest.mark.parametrize("options", [{"quant": "int8"}, {"compile": True}, {"quant": "int4", "compile": True}],
                         ids=["int8", "compile", "int4-compile"])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts child processes in /proc")
def test_tensor_parallel_stacks_with_formats_and_compile(tiny_model_dir, options):
    code = CHILD.format(root=str(REPO_ROOT), model=str(tiny_model_dir), options=json.dumps(options),
                        prompts=json.dumps(PROMPTS))
    out = run_child(code, timeout=600)
    assert out["same"], out
    assert out["workers"] >= 1 and out["left"] == 0, out   # close() stopped the worker and its helpers
    assert out["quant"].startswith(options.get("quant", "float32"))


def test_every_single_process_feature_at_once_matches_its_format_alone(tiny_model_dir):
    """int4 weights + prefix caching + n-gram speculation + compiled steps: greedy output equals
    the int4 engine's, token for token."""
    from minivllm import LLM, SamplingParams

    params = SamplingParams(ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[0]]          # the repeat hits the prefix cache
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=8 << 20, block_size=4, quant="int4") as plain:
        expected = [r.output_ids for r in plain.generate_batch(prompts, 16, params)]
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=8 << 20, block_size=4, quant="int4",
             prefix_caching=True, speculative="ngram", compile=True) as stacked:
        got = [stacked.generate(p, 16, params).output_ids for p in prompts]
        assert stacked.features()["prefix_caching"] and stacked.features()["compile"]
        assert stacked.stats()["prefix_cache_hit_rate"] > 0
    assert got == expected
