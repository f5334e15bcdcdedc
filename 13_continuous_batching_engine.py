"""13_continuous_batching_engine.py - Chapter 9: continuous batching. Requests join and leave every step.

Static batching (Chapter 5) takes a batch, runs it until its longest member is done,
and only then looks at the queue again. A continuous-batching engine looks at the
queue before *every* step: the scheduler (13_scheduler.py) fills one ragged batch with
each running request's next token and, while the token budget and the KV pool allow,
chunks of new prompts. A request that finishes leaves at once; its blocks go to the
next one in line.

This is the book's engine assembled, in the package: the step (schedule -> run -> postprocess)
is `minivllm/engine.py`, the loop that serves live traffic `minivllm/engine_loop.py`, and `LLM`
(`minivllm/llm.py`; `--engine minivllm:LLM` for the server and the benchmarks) wires every
chapter's feature into it. This script sends it one prompt. Every part comes from its own
chapter and is composed, not rewritten: the output processor (Chapter 2), the model runner
(Chapter 6), the KV pool and block manager (Chapter 7), the prefix cache (Chapter 8), the
scheduler (13_scheduler.py), and weights in any format (Chapter 12). Each feature is a keyword
of the constructor, with the same name as the flag of 05_server.py and of both benchmarks:

    quant, group_size, quant_head   weight format: None (float32), "bf16", "int8", "int4"
    prefix_caching                  share the K/V blocks of prompt prefixes seen before
    kv_memory, block_size           the KV pool: bytes, and tokens per block
    max_num_seqs                    sequences in one step, at most
    max_num_batched_tokens          tokens in one step, at most (the prefill chunk size)
    speculative, num_speculative_tokens, draft_model
                                    guess tokens and verify them in one step (Chapter 10)
    tensor_parallel_size            the model split over N processes (Chapter 14)
    compile                         packed weights, fused ops, paged attention (Chapter 13)

    python 13_continuous_batching_engine.py --quant int8 --prefix-caching   # one prompt, as 04_engine.py
    python 13_continuous_batching_demo.py                # a mixed workload, traced step by step
    python 05_server.py --engine minivllm:LLM --quant int8 --prefix-caching

For live traffic `submit()` hands a request to a background thread that steps the
scheduler while there is work; the caller reads text pieces, then the GenerateResult,
from the request's own queue, and `abort()` frees its blocks at the next step
(so does dropping the stream unread). `close()` ends the loop.
"""

from __future__ import annotations


from kit.demo import engine_main
from minivllm import LLM



def main() -> None:
    engine, _, _ = engine_main(LLM, "Chapter 9: the assembled engine, every feature a switch.")
    print(f"  {'features':<15} {engine.features()}")
    engine.close()


if __name__ == "__main__":
    main()
