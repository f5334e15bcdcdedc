"""Chapter 5 exercises: static batching (09_static_batching.py) (solutions)."""




# Exercise 5.1 (predict, then measure). Four prompts of 10, 20, 30 and 40 tokens, left-padded
# into one batch: what share of the prefill's positions is padding (09_static_batching.padding_waste)?
# Tolerance: 0.01.
# why: 30 + 20 + 10 = 60 pads among 4 x 40 = 160 positions.
PREFILL_PADDING_SHARE = 60 / 160


# Exercise 5.2 (predict, then measure). Two prompts of 10 and 40 tokens, 11 new tokens each:
# what share of the keys read during the decode steps are padding? Tolerance: 0.02.
# why: 30 pads are read at each of the 10 decode steps; step t reads 2 x (40 + t) keys in all.
DECODE_PADDING_SHARE = 30 * 10 / sum(2 * (40 + t) for t in range(1, 11))


def check_batching(engine) -> None:
    """Exercise 5.3 (find the bug): raise AssertionError if this StaticBatchEngine's batched
    greedy answers differ from its one-at-a-time answers. Called on the real engine and on one
    with a defect planted in how a batch is laid out."""
    from minivllm.contracts import SamplingParams
    params = SamplingParams(ignore_eos=True)
    prompts = ["Hi", "The capital of France is a city that", "Tell me one thing"]
    alone = [engine.generate(p, 6, params).output_ids for p in prompts]
    together = [r.output_ids for r in engine.generate_batch(prompts, 6, params)]
    assert together == alone, f"batched {together} != alone {alone}"

