"""scripts/classroom_load.py - eight students at once against one alone, on a running server.

Each round sends one streamed chat alone, then eight at the same moment, and times each first
token (TTFT) at the client. The ratio that matters to a class: the slowest of the eight against
the lone student's, both from the same server in the same sitting. Rounds alternate, so the
machine's noise falls on both alike; the median of the rounds is printed with their spread.

    python 05_server.py --engine minivllm:LLM --api-key class-secret &
    python scripts/classroom_load.py --url http://127.0.0.1:8001 --api-key class-secret
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import httpx
import torch

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about GPUs.", "What is 12 times 7?", "Give me a synonym for happy.",
             "What does a CPU do?", "Say hello in Spanish."]


async def first_token_s(client: httpx.AsyncClient, url: str, question: str, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"content":""' not in line.replace(" ", ""):
                first = time.perf_counter() - t0
    return first


async def main_async(args) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ratios, lones, slowest = [], [], []
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        await first_token_s(client, args.url, QUESTIONS[0], 4)   # warm-up, not counted
        for i in range(args.rounds):
            # Each round's questions are new to the server (a prefix cache finds the chat template's
            # system prompt, which every student shares, but no earlier round's whole question).
            lone = await first_token_s(client, args.url, f"{QUESTIONS[i % len(QUESTIONS)]} (round {i + 1}, alone)",
                                       args.max_tokens)
            many = await asyncio.gather(*(first_token_s(client, args.url, f"{q} (round {i + 1})", args.max_tokens)
                                          for q in QUESTIONS[: args.students]))
            lones.append(lone)
            slowest.append(max(many))
            ratios.append(max(many) / lone)
            print(f"round {i + 1}: lone TTFT {lone * 1000:.0f} ms, slowest of {args.students} "
                  f"{max(many) * 1000:.0f} ms, ratio {ratios[-1]:.2f}", flush=True)
    print(f"slowest first token of {args.students} / a lone student's: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.rounds} alternating rounds; "
          f"lone median {statistics.median(lones) * 1000:.0f} ms, slowest median "
          f"{statistics.median(slowest) * 1000:.0f} ms")
    print(f"machine: {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d', time.gmtime())}, "
          f"server threads as started, torch {torch.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Eight concurrent chats against a lone one: the slowest TTFT ratio.")
    parser.add_argument("--url", default="http://127.0.0.1:8001")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--students", type=int, default=8, choices=range(1, len(QUESTIONS) + 1), metavar="N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
