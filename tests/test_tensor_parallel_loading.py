"""Chapter 14: each rank reads only its own slices of the checkpoint.

The weights a rank reads for itself (`load_model` with `Shard`, which asks the loader for its
`part` of each tensor) must be, bit for bit, what `shard()` cuts from the model read whole; no
rank may read a whole matrix; and when the ranks outnumber the KV heads, each KV head is copied
to the ranks whose query heads read it (as vLLM does), with greedy output unchanged.

Tiny random Llamas of several shapes, saved as checkpoints; no process group except in the last
test (in a process of its own: a process holds one group)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors import safe_open

from conftest import REPO_ROOT, run_child
from minivllm import model as model_module
from minivllm.collectives import Collectives
from minivllm.model import LlamaModel, ModelConfig
from minivllm.model_runner import load_model
from minivllm.parallel import Shard, VocabShard, check_size, shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (attention heads, KV heads, vocabulary beyond the tokenizer's, tied LM head), and the sizes to load at
SHAPES = {"4h-2kv": ((4, 2, 0, True), [2]),
          "6h-3kv-padded-untied": ((6, 3, 1, False), [3]),         # 49,153 words: the last rank pads
          "2h-1kv": ((2, 1, 0, True), [2]),                         # one KV head, copied to both ranks
          "4h-2kv-replicated": ((4, 2, 0, True), [4])}               # two ranks per KV head


def save_tiny(out, heads: int, kv_heads: int, extra_vocab: int = 0, tied: bool = True, tokenizer_from=None):
    """A random 2-layer Llama checkpoint of this shape (head_dim 16), with the real tokenizer if asked."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from) if tokenizer_from else None
    config = LlamaConfig(vocab_size=49152 + extra_vocab, hidden_size=16 * heads, head_dim=16,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=tied)
    if tokenizer:
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(heads * 10 + kv_heads)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    if tokenizer:
        tokenizer.model_max_length = 512
        tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: save_tiny(tmp_path_factory.mktemp(name), *shape) for name, (shape, _) in SHAPES.items()}


def leaf(w):
    return w.wrapped if hasattr(w, "wrapped") else w


@pytest.mark.parametrize("name,size", [(name, n) for name, (_, sizes) in SHAPES.items() for n in sizes])
def test_each_rank_reads_bit_for_bit_its_shard_of_the_whole_model(checkpoints, name, size):
    folder = checkpoints[name]
    whole = LlamaModel.from_folder(folder)
    c, d = whole.config, whole.config.head_dim
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        q, k = f.get_tensor("model.layers.1.self_attn.q_proj.weight"), f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        v, o = f.get_tensor("model.layers.1.self_attn.v_proj.weight"), f.get_tensor("model.layers.1.self_attn.o_proj.weight")
    for rank in range(size):
        comm = Collectives(rank, size, "cpu")
        read = load_model(folder, torch.float32, "cpu", [Shard(rank, size, comm)])
        cut = shard(whole, rank, size, comm)
        assert read.config == cut.config and read.w.keys() == cut.w.keys()
        for key in read.w:
            a, b = read.w[key], cut.w[key]
            assert type(a) is type(b), key
            assert torch.equal(leaf(a), leaf(b)) and leaf(a).stride() == leaf(b).stride(), key
        assert (read.w["lm_head"] is read.w["embed"]) == c.tie_word_embeddings
        assert isinstance(read.w["embed"], VocabShard) and read.w["embed"].start == cut.w["embed"].start
        # Megatron's split, spelled out once more from the checkpoint: whole query heads, the KV
        # head(s) they read (a copy when ranks outnumber KV heads), O's matching input columns.
        heads, kv_heads = c.num_heads // size, max(1, c.num_kv_heads // size)
        first_kv = rank * c.num_kv_heads // size
        qs, kvs = slice(rank * heads * d, (rank + 1) * heads * d), slice(first_kv * d, (first_kv + kv_heads) * d)
        assert (read.config.num_heads, read.config.num_kv_heads) == (heads, kv_heads)
        assert torch.equal(read.w["model.layers.1.qkv"], torch.cat([q[qs], k[kvs], v[kvs]]))
        assert torch.equal(leaf(read.w["model.layers.1.o"]), o[:, qs])


class Counting:
    """safe_open as the loader sees it, counting the bytes of every tensor handed out, and
    refusing to hand out a whole matrix."""

    read = 0

    def __init__(self, file, framework):
        self.inner = safe_open(file, framework=framework)

    def __enter__(self):
        self.f = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        assert t.dim() < 2, f"{name} read whole"
        Counting.read += t.numel() * t.element_size()
        return t

    def get_slice(self, name):
        stored = self.f.get_slice(name)

        class Slice:
            def get_shape(self):
                return stored.get_shape()

            def __getitem__(self, index):
                t = stored[index]
                Counting.read += t.numel() * t.element_size()
                return t
        return Slice()


def test_a_rank_reads_only_its_share_of_the_bytes(checkpoints, monkeypatch):
    folder = checkpoints["4h-2kv"]
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        sizes = {n: f.get_tensor(n).numel() * 4 for n in f.keys()}
    norms = sum(b for n, b in sizes.items() if "norm" in n)
    monkeypatch.setattr(model_module, "safe_open", Counting)
    for rank in range(2):
        Counting.read = 0
        load_model(folder, torch.float32, "cpu", [Shard(rank, 2, Collectives(rank, 2, "cpu"))])
        assert Counting.read == (sum(sizes.values()) - norms) // 2 + norms   # every matrix halved, norms whole


def config_of(heads: int, kv_heads: int, mlp: int = 96) -> ModelConfig:
    return ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=mlp, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=True)


def test_ranks_may_outnumber_kv_heads_when_they_share_them_evenly():
    check_size(config_of(4, 2), 4)               # two ranks per KV head
    check_size(config_of(8, 2), 8)
    check_size(config_of(9, 3), 3)
    with pytest.raises(ValueError, match=r"does not divide the model's 6 attention heads: .*"
                                         r"copied evenly to them \(sizes that fit: 1, 2\)"):
        check_size(config_of(6, 4), 4)
    with pytest.raises(ValueError, match="does not divide the model's 3 KV heads"):
        check_size(config_of(6, 3), 2)           # 2 neither divides 3 nor is a multiple of it


CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{root!r}]
    from minivllm import LLM, SamplingParams
    from minivllm import model
    params, prompts = SamplingParams(ignore_eos=True), json.loads({prompts!r})
    with LLM({folder!r}, device="cpu", kv_memory=4 << 20) as one:
        expected, blocks = [r.output_ids for r in one.generate_batch(prompts, 12, params)], one.runner.kv.num_blocks
    whole = []                              # rank 0, this process, must read no matrix whole
    real = model.safe_open
    class Watch:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)
        def __enter__(self):
            inner = self.f.__enter__()
            class F:
                keys, get_slice = inner.keys, inner.get_slice
                def get_tensor(self, name):
                    t = inner.get_tensor(name)
                    if t.dim() > 1:
                        whole.append(name)
                    return t
            return F()
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)
    model.safe_open = Watch
    with LLM({folder!r}, device="cpu", kv_memory=4 << 20, tensor_parallel_size=2) as two:
        got = [r.output_ids for r in two.generate_batch(prompts, 12, params)]
        stats = two.runner.rank_stats()
        out = {{"same": got == expected, "whole": whole, "blocks": [blocks, two.runner.kv.num_blocks],
                "kv_heads": [s["kv_heads"] for s in stats], "heads": [s["heads"] for s in stats]}}
    print("RESULT", json.dumps(out))
""")


def test_one_kv_head_copied_to_two_ranks_gives_the_same_tokens(tmp_path, tiny_model_dir, reference_prompts):
    """2 query heads, 1 KV head, 2 ranks: each rank owns one query head and a copy of the KV head."""
    folder = save_tiny(tmp_path / "2h-1kv", 2, 1, tokenizer_from=tiny_model_dir)
    code = CHILD.format(root=str(REPO_ROOT), folder=str(folder), prompts=json.dumps(reference_prompts[:4]))
    out = run_child(code, timeout=300)
    assert out["same"], out
    assert out["whole"] == [], out                              # rank 0 read only its slices
    assert out["blocks"][0] == out["blocks"][1], out            # each rank holds the whole KV head: blocks as on one
    assert out["heads"] == [1, 1] and out["kv_heads"] == [1, 1], out
