"""03_contracts.py - the types every engine, server and benchmark agrees on.

Three plain dataclasses, and deliberately no torch import: whatever an engine does
inside, what goes in (`SamplingParams`) and what comes out (`GenerateResult`, with
its `RequestMetrics`) are ordinary Python values that a server can turn into JSON
and a benchmark can add up. They live in the engine's package, `minivllm/contracts.py`,
beside `BaseOfflineEngine`; this script shows them at work.

    python 03_contracts.py     # shows the defaults and what bad values do
"""

from __future__ import annotations

from minivllm.contracts import GenerateResult, RequestMetrics, SamplingParams


def main() -> None:
    import argparse

    argparse.ArgumentParser(description="Show SamplingParams' defaults and what bad values do.").parse_args()
    print("[SamplingParams()]")
    params = SamplingParams()
    print(f"  {params}\n  is_greedy = {params.is_greedy}")
    print("\n[SamplingParams(temperature=0.8, top_p=0.95, seed=7)]")
    print(f"  is_greedy = {SamplingParams(temperature=0.8, top_p=0.95, seed=7).is_greedy}")
    print("\n[bad values are refused at construction]")
    for bad in ({"temperature": -1.0}, {"temperature": float("inf")}, {"top_p": 0.0}, {"top_p": 1.5},
                {"top_k": -3}, {"max_tokens": 0}, {"seed": 2**70}, {"presence_penalty": 2.5},
                {"repetition_penalty": 0.0}, {"logit_bias": {42: 101.0}}, {"logprobs": 21},
                {"structured": {"json_schema": "[1, 2"}}, {"structured": {"regex": ""}}):
        try:
            SamplingParams(**bad)
        except ValueError as exc:
            print(f"  SamplingParams(**{bad}) -> ValueError: {exc}")
    print("\n[RequestMetrics.as_dict() leaves out what was not measured]")
    print(f"  baseline-style: {RequestMetrics(throughput=30.2, input_tokens=12, output_tokens=40).as_dict()}")
    print(f"  loop-style:     {RequestMetrics(30.2, 12, 40, ttft_ms=45.0, tpot_ms=32.1).as_dict()}")
    result = GenerateResult(text=" Paris.", output_ids=[7042, 30, 2],
                            metrics=RequestMetrics(25.0, 5, 3), finish_reason="stop")
    print(f"\n[GenerateResult]\n  {result}")


if __name__ == "__main__":
    main()
