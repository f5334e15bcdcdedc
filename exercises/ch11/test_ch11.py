"""Chapter 11's exercises: xgrammar's masks on SmolLM2's tokenizer, the LLM on the tiny model."""

import pytest

from harness import catches, patched, within
from minivllm import LLM
from minivllm.model_files import load_tokenizer
from minivllm.structured import make_constraint


def test_11_1_choice(answers, tiny_model_dir):
    t = load_tokenizer(tiny_model_dir)
    mask = make_constraint(t, len(t), {t.eos_token_id}, ("choice", ("yes", "no"))).allowed_mask()
    within(answers.CHOICE_FIRST_TOKENS, int(mask.sum()), what="CHOICE_FIRST_TOKENS")


def test_11_2_unique_items(answers):
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
        "rows": {"type": "array", "items": {"type": "array", "uniqueItems": True}},
        "free": {"type": "array"}}}
    assert answers.unique_items_errors('{"tags": ["a", "b"], "free": [1, 1]}', schema) == []
    assert len(answers.unique_items_errors('{"tags": ["a", "a"]}', schema)) == 1
    assert len(answers.unique_items_errors('{"rows": [[1, 2], [3, 3], [{"x": 1}, {"x": 1}]]}', schema)) == 2
    assert answers.unique_items_errors('{"rows": [[1, "1"], [true, 1]]}', schema) == []


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20) as llm:
        yield llm


# --- the planted defect (read it after you have tried) ---------------------------------------
def bits_shifted(original):
    def unpack_bits(words, vocab):
        return original(words, vocab).roll(1, dims=-1)     # token i reads token i-1's bit
    return unpack_bits


def test_11_3_find_the_bug(answers, engine):
    catches(answers.check_digits_only, lambda: patched("minivllm.output:unpack_bits", bits_shifted),
            lambda: engine, what="check_digits_only")
