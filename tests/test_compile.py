"""Chapter 13: compiled steps compute what eager steps compute.

Paged decode attention is checked against Chapter 7's gather + SDPA on ragged rows in shuffled
blocks, eager and compiled; the compiled model against Chapter 6's forward on prefills, decodes,
mixed steps and speculative verifications; the engine with compile=True against compile=False,
token for token, with preemption and prefix caching. Compilation is shared by the whole file
(inductor caches its kernels on disk, so later runs pay for none of it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import load_script
from minivllm import LLM
from minivllm.batch import RaggedBatch
from minivllm.compile import Compile, Compiled, FUSED_GLUE_MIN_TOKENS, compile_model, paged_decode_attention, silu_mul
from minivllm.contracts import SamplingParams
from minivllm.kv_cache import KVPool
from minivllm.model import LlamaModel

compile17 = load_script("17_compile")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gathered_attention(q, k_pool, v_pool, tables, lens, block_size):
    """The eager reference: copy each row's blocks into a rectangle, mask, SDPA."""
    n, width = tables.shape
    kv_heads, dim = k_pool.shape[1:]
    k = k_pool.view(-1, block_size, kv_heads, dim)[tables].view(n, -1, kv_heads, dim).transpose(1, 2)
    v = v_pool.view(-1, block_size, kv_heads, dim)[tables].view(n, -1, kv_heads, dim).transpose(1, 2)
    mask = (torch.arange(width * block_size).view(1, -1) < lens.view(n, 1)).view(n, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
    return out.reshape(n, -1)


@pytest.fixture(scope="module", params=["copy", "compiled", "kernel"])
def models(tiny_model_dir, request):
    """Each way decode rows attend, with the glue fused in every step (threshold 0), so that
    these small steps check the fused kernels too."""
    eager = LlamaModel.from_folder(tiny_model_dir)
    return eager, compile_model(eager, decode_attention=request.param, fused_glue_min_tokens=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_paged_decode_attention_is_exact_on_ragged_rows(compiled):
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, dim = 4, 40, 6, 2, 8
    k_pool, v_pool = (torch.randn(num_blocks * block_size, kv_heads, dim) for _ in range(2))
    lens = torch.tensor([1, 5, 13, 16, 9])        # one token, a block and one, exactly full, ...
    tables = torch.randperm(num_blocks)[:5 * 4].view(5, 4)   # shuffled blocks, padded rows
    q = torch.randn(5, heads, dim)
    fn = Compiled(paged_decode_attention, enabled=compiled)
    out = fn(q, k_pool, v_pool, tables, lens, block_size)
    assert fn.compiled is not None or not compiled, "the compiled path fell back to eager"
    torch.testing.assert_close(out, gathered_attention(q, k_pool, v_pool, tables, lens, block_size),
                               atol=1e-5, rtol=1e-5)


def test_cpu_kernel_matches_plain_torch_on_ragged_rows_and_refuses_bad_tables():
    """The C++ kernel against the same attention as copy + SDPA: one token, a block and one,
    exactly full blocks, shuffled blocks, grouped-query heads, one row and a width of one block;
    a table pointing outside the pool or a length beyond its table is an error, not a read."""
    from minivllm import cpu_attention
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, dim = 4, 40, 6, 2, 8
    k_pool, v_pool = (torch.randn(num_blocks * block_size, kv_heads, dim) for _ in range(2))
    assert cpu_attention.available(k_pool), "the kernel could not be built here"
    lens = torch.tensor([1, 5, 13, 16, 9])
    tables = torch.randperm(num_blocks)[:5 * 4].view(5, 4)
    q = torch.randn(5, heads, dim)
    for rows, width in ((slice(None), 4), (slice(1, 2), 2), (slice(0, 1), 1)):
        args = (q[rows], k_pool, v_pool, tables[rows, :width].contiguous(), lens[rows], block_size)
        torch.testing.assert_close(cpu_attention.paged_decode_attention(*args), gathered_attention(*args),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, tables + num_blocks, lens, block_size)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, tables[:, :2].contiguous(), lens, block_size)


def test_cpu_kernel_splits_its_work_over_torchs_threads():
    """Built without OpenMP, at::parallel_for would quietly run every loop on one thread."""
    from minivllm import cpu_attention
    assert cpu_attention.available(torch.zeros(1, 1, 1)), "the kernel could not be built here"
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert cpu_attention.parallel_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_without_the_kernel_auto_falls_back_to_the_copy(tiny_model_dir, monkeypatch):
    from minivllm import cpu_attention
    eager = LlamaModel.from_folder(tiny_model_dir)
    compiled = compile_model(eager)
    pool = KVPool(eager.config, 16, 4)
    assert compiled.decode_attention_for(pool) == "kernel"
    monkeypatch.setattr(cpu_attention, "available", lambda k: False)
    assert compiled.decode_attention_for(pool) == "copy"
    assert compiled.decode_attention_for(eager.new_cache(1, 8)) == "copy"   # a cache of rows has no blocks
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        Compile(decode_attention="fast")


def test_compiled_model_matches_eager_on_every_kind_of_step(models):
    """Prefill, ragged decodes, a prefill chunk beside decodes, a verification of 3 tokens:
    two pools, one per model, fed the same steps."""
    eager, compiled = models
    pools = [KVPool(eager.config, 32, 4) for _ in range(2)]
    tables = [[5, 9, 2, 30, 31], [7, 1, 3, 29, 28], [11, 12, 13, 14, 15]]
    steps = [([[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35]], [0, 0, 0], None),
             ([[40], [41], [42]], [9, 3, 6], None),
             ([[43], [44, 45, 46, 47], [48]], [10, 4, 7], None),
             ([[49, 50, 51], [52], [53]], [11, 8, 8], [3, 1, 1])]
    for ids, starts, num_logits in steps:
        out = [m.forward(pool.batch(ids, tables, starts, "cpu"), pool, num_logits=num_logits)
               for m, pool in zip((eager, compiled), pools)]
        torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)
    used = [name for name in compiled.ops if name != "paged_decode_attention" or compiled.decode_attention == "compiled"]
    assert all(compiled.ops[name].compiled is not None for name in used), "an op fell back to eager"


@pytest.mark.parametrize("threshold", [0, 6, 1 << 20])
def test_the_glue_is_fused_only_from_the_threshold_on(tiny_model_dir, threshold):
    """Steps of 5 and 6 tokens: each runs the fused ops only at or above the threshold, and the
    logits are the eager model's either way."""
    eager = LlamaModel.from_folder(tiny_model_dir)
    compiled = compile_model(eager, fused_glue_min_tokens=threshold)
    calls = []
    for name in ("add_rms_norm", "rope_split", "silu_mul"):
        op = compiled.ops[name]
        op.compiled = (lambda fn: lambda *args: calls.append(fn.__name__) or fn(*args))(op.fn)
    pools = [KVPool(eager.config, 16, 4) for _ in range(2)]
    for n in (5, 6):
        calls.clear()
        out = [m.forward(pool.batch([list(range(1, n + 1))], [[0, 1]], [0], "cpu"), pool)
               for m, pool in zip((eager, compiled), pools)]
        torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)
        assert bool(calls) == (n >= threshold), (n, threshold, calls)
    with pytest.raises(ValueError, match="fused_glue_min_tokens"):
        compile_model(eager, fused_glue_min_tokens=-1)


def test_compiled_model_on_chapter_6_rows_cache(models):
    """A cache of rows (Chapter 6's engine) has no block tables: every part takes the copy path."""
    eager, compiled = models
    caches = [eager.new_cache(2, 32) for _ in range(2)]
    for ids, starts in (([[1, 2, 3, 4], [5, 6]], [0, 0]), ([[7], [8]], [4, 2])):
        out = [m.forward(RaggedBatch.build(ids, [0, 1], starts, 32), cache)
               for m, cache in zip((eager, compiled), caches)]
        torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)


def test_a_failing_compiler_falls_back_to_eager(capsys):
    op = Compiled(silu_mul)

    def broken(*args):
        raise RuntimeError("no C++ compiler on this machine")

    op.compiled = broken
    x = torch.randn(3, 8)
    torch.testing.assert_close(op(x), silu_mul(x))
    assert op.compiled is None and "falling back to eager" in capsys.readouterr().out


def test_engine_with_compile_answers_as_without(tiny_model_dir, reference_prompts):
    """Greedy, token for token, with a pool small enough to preempt and a shared prefix cached."""
    system = "You are a careful assistant. Answer briefly. " * 3
    texts = [system + p for p in reference_prompts[:6]] + reference_prompts[:2]
    answers = []
    for compile_ in (False, True):
        engine = LLM(str(tiny_model_dir), device="cpu", kv_memory=96 << 10, block_size=4,
                     prefix_caching=True, max_num_batched_tokens=48, compile=compile_)
        assert engine.features()["compile"] is compile_
        results = engine.generate_batch(texts, 16, SamplingParams(ignore_eos=True))
        answers.append([r.output_ids for r in results])
        assert not engine.scheduler.has_work() and not engine.blocks.tables   # every block given back
        engine.close()
    assert answers[1] == answers[0]


def test_bad_compile_settings_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="compile must be True or False"):
        LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, compile="yes")
    with pytest.raises(ValueError, match="tensor_parallel_size"):   # compile stacks with a shard, not with a bad size
        LLM(str(tiny_model_dir), device="cpu", compile=True, tensor_parallel_size=0)


def test_compiling_leaves_the_process_wide_shape_setting_alone(tiny_model_dir):
    """use_duck_shape=False holds only while the engine's own kernels are traced: building and
    warming up a compiled model leaves torch's global setting as it found it, and every call
    into a compiled op (the one place a first or a later compilation happens) sees it off."""
    import torch.fx.experimental._config as fx_config
    # A torch config module is not a plain module: monkeypatch's undo would delete the setting,
    # so it is set and put back by assignment.
    saved, fx_config.use_duck_shape = fx_config.use_duck_shape, True
    try:
        eager = LlamaModel.from_folder(tiny_model_dir)
        compiled = compile_model(eager)
        compiled.warm_up(KVPool(eager.config, 16, 4))
        assert fx_config.use_duck_shape is True
        op, seen = Compiled(silu_mul), []
        op.compiled = lambda *args: seen.append(fx_config.use_duck_shape) or silu_mul(*args)
        op(torch.randn(3, 8))
        assert seen == [False] and fx_config.use_duck_shape is True
    finally:
        fx_config.use_duck_shape = saved


def test_glue_costs_time_both_ways_and_put_the_threshold_back(tiny_model_dir, capsys):
    eager = LlamaModel.from_folder(tiny_model_dir)
    compiled = compile_model(eager)
    pool = KVPool(eager.config, 32 * 3 + 40, 16)
    rows = compile17.glue_costs(compiled, pool, rounds=1, context=20)
    assert [r[1] for r in rows] == [1, 8, 32, 64, 128, 256, 512]
    assert all(fused > 0 and eager_ms > 0 for _, _, fused, eager_ms in rows)
    assert compiled.fused_glue_min_tokens == FUSED_GLUE_MIN_TOKENS
    compile17.print_glue_costs(rows)
    assert "prefill, 512 tokens" in capsys.readouterr().out
