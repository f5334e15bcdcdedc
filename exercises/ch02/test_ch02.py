"""Chapter 2's exercises, on Chapter 2's engine over the tiny random model."""

import importlib

import pytest

from harness import catches, patched, within
from minivllm.contracts import SamplingParams

decode_loop = importlib.import_module("07_decode_loop")
GREEDY = SamplingParams(ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return decode_loop.DecodeLoopEngine(str(tiny_model_dir), device="cpu")


def counted(engine, prompt, n):
    calls, lengths = [], []
    step = engine.decode_step

    def counting(token_ids, attention_mask, position_ids, cache):
        calls.append(1)
        out = step(token_ids, attention_mask, position_ids, cache)
        lengths.append(cache.get_seq_length())
        return out
    engine.decode_step = counting
    try:
        result = engine.generate(prompt, n, GREEDY)
    finally:
        del engine.decode_step
    return len(calls), lengths[-1], result


def test_2_1_decode_steps(answers, engine):
    within(answers.DECODE_STEPS_FOR_10_TOKENS, counted(engine, "Hello there", 10)[0],
           what="DECODE_STEPS_FOR_10_TOKENS")


def test_2_2_cache_length(answers, engine):
    for prompt, n in (("Hi", 5), ("The capital of France is", 12), ("one two three four five six", 3)):
        n_prompt = len(engine.tokenizer(prompt)["input_ids"])
        within(answers.cached_tokens_after(n_prompt, n), counted(engine, prompt, n)[1],
               what=f"cached_tokens_after({n_prompt}, {n})")


# --- the planted defect (read it after you have tried) ---------------------------------------
def first_token_time_overwritten(original):
    def accept(self, r, token_id, now):
        piece = original(self, r, token_id, now)
        r.t_first = now            # every token is "the first": TTFT becomes the whole latency
        return piece
    return accept


def test_2_3_find_the_bug(answers, engine):
    catches(answers.check_timings, lambda: patched("minivllm.output:OutputProcessor.accept",
                                                   first_token_time_overwritten),
            lambda: engine.generate("Tell me a story", 8, GREEDY), what="check_timings")
