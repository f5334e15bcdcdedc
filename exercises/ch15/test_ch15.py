"""Chapter 15's exercises: buckets, the scratch block, and the padded path (on the CPU, eagerly)."""

import pytest

from harness import catches, patched, within
from minivllm import LLM
from minivllm.contracts import SamplingParams
from minivllm.cuda_graphs import bucket_for, buckets

TINY_BLOCK_BYTES = 512 * 16      # the tiny model's 512 bytes of KV per token, blocks of 16
PROMPTS = ["Hi", "The capital of France is", "Tell me a story about"]


def test_15_1_bucket(answers):
    within(answers.BUCKET_FOR_17, bucket_for(17, buckets(32)), what="BUCKET_FOR_17")
    within(answers.PADDING_ROWS_FOR_17, bucket_for(17, buckets(32)) - 17, what="PADDING_ROWS_FOR_17")


def graphs_engine(folder):
    return LLM(str(folder), device="cpu", kv_memory=64 * TINY_BLOCK_BYTES, block_size=16, enforce_eager=False,
               max_num_seqs=8)


def test_15_2_scratch_block(answers, tiny_model_dir):
    with graphs_engine(tiny_model_dir) as llm:
        assert llm.runner.kv.num_blocks == 64
        within(answers.USABLE_BLOCKS, llm.scheduler.blocks.num_blocks, what="USABLE_BLOCKS")


@pytest.fixture(scope="module")
def eager(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=64 * TINY_BLOCK_BYTES, block_size=16) as llm:
        return [r.output_ids for r in llm.generate(PROMPTS, 8, SamplingParams(ignore_eos=True))]


def padded_ids(folder):
    with graphs_engine(folder) as llm:
        return [r.output_ids for r in llm.generate(PROMPTS, 8, SamplingParams(ignore_eos=True))]


# --- the planted defect (read it after you have tried) ---------------------------------------
def padding_writes_block_0(original):
    def fill(self, requests, starts, places):
        size = original(self, requests, starts, places)
        self.static.slots[len(requests):size] = 0       # slot 0 of block 0: somebody's first token
        return size
    return fill


def test_15_3_find_the_bug(answers, eager, tiny_model_dir):
    catches(lambda ids: answers.check_graphs_agree(eager, ids),
            lambda: patched("minivllm.cuda_graphs:CUDAGraphRunner.fill", padding_writes_block_0),
            lambda: padded_ids(tiny_model_dir), what="check_graphs_agree")
