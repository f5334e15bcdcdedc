"""The classroom page under a class's traffic, captured for Chapter 9's page.

Starts 05_server.py with Chapter 9's engine (prefix caching on), sends one request to put the
class's shared system prompt in the prefix cache, then thirty streamed chat requests at once
(thirty students pressing Send), opens the page in headless Chromium while they run and saves
what it shows once requests are in every state it can find.

    python scripts/screenshot_scheduler.py                          # book/assets/ch9-classroom-scheduler.png
    python scripts/screenshot_scheduler.py --dark --out /tmp/dark.png
    python scripts/screenshot_scheduler.py --model PATH --out /tmp/tiny.png   # any model folder

Needs Debian's chromium and chromium-driver and selenium, as tests/test_browser.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from kit import launcher  # noqa: E402
from minivllm.snapshot import FINISHED_KEEP_S  # noqa: E402

ENGINE = "minivllm:LLM"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SYSTEM = ("You are the teaching assistant of a class on how large language models are served. "
          "Answer the student's question in two or three plain sentences, without lists or code.")
QUESTIONS = ["What is a token?", "Why is the first token slow?", "What is a KV cache?", "What does prefill mean?",
             "What is decode?", "Why batch requests?", "What is a GPU good at?", "What is attention?",
             "Why do long prompts cost more?", "What is quantization?", "What is a scheduler?",
             "What is preemption?", "What is prefix caching?", "What is TTFT?", "What is a block table?",
             "Why page the KV cache?", "What limits the batch size?", "What is greedy decoding?",
             "What is temperature?", "What is top-p sampling?", "Why stream the answer?",
             "What is speculative decoding?", "What is a context window?", "What is a logit?",
             "What makes a model fast?", "What is continuous batching?", "What is memory bandwidth?",
             "What is an embedding?", "Why do answers differ?", "What is an inference engine?"]


def chat(i: int, max_tokens: int) -> dict:
    """Student i's request: the class's system prompt (a shared prefix), then their own question."""
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> int:
    """Read one stream to its end; the number of events it brought."""
    events = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
    return events


def class_traffic(url: str, students: int = 30, max_tokens=lambda i: 16 + 8 * (i % 6)) -> threading.Thread:
    """`students` streamed chat requests at once, from a thread (started); join it to wait for the answers.
    Its `events` attribute then holds each stream's number of events."""
    async def everyone():
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(_one(client, url, chat(i, max_tokens(i))) for i in range(students)))

    def run():
        try:
            thread.events = asyncio.run(everyone())
        except httpx.HTTPError as exc:   # the server went away first (the screenshot was taken)
            thread.error = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.events = thread.error = None
    thread.start()
    return thread


def warm_prefix_cache(url: str) -> None:
    """One request first, so that the system prompt's blocks are cached when the class arrives."""
    httpx.post(f"{url}/v1/chat/completions", json={**chat(0, 1), "stream": False}, timeout=600).raise_for_status()


def browser(dark: bool = False, width: int = 1600, height: int = 1640):
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    if dark:
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                               {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    return driver


def page_counts(driver) -> dict:
    """What the page shows now: rows by state, and blocks by kind."""
    return driver.execute_script("""
        const rows = [...document.querySelectorAll('#requests tbody tr')].map((tr) => tr.className);
        const count = (s) => rows.filter((c) => c === s).length;
        return {rows: rows.length, waiting: count('waiting'), prefill: count('prefill'), decode: count('decode'),
                preempted: count('preempted'), finished: count('finished'),
                owned: document.querySelectorAll('#kv-grid .owned').length,
                shared: document.querySelectorAll('#kv-grid .shared').length};""")


def save(driver, path: str) -> None:
    """The window, cut just below the scheduler's panel (the chat beside it stays in the picture)."""
    from PIL import Image

    driver.save_screenshot(path)
    bottom = driver.execute_script("return (document.getElementById('scheduler').getBoundingClientRect().bottom"
                                   " + 16) * window.devicePixelRatio;")
    with Image.open(path) as image:
        image.crop((0, 0, image.width, min(image.height, int(bottom)))).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Screenshot the classroom page's scheduler under 30 streams.")
    parser.add_argument("--model", default=None, help="model folder (default: the book's SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=str(REPO_ROOT / "book/assets/ch9-classroom-scheduler.png"))
    parser.add_argument("--dark", action="store_true", help="the dark colour scheme")
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--kv-memory", default="96MB", help="the KV pool (default 96MB: a grid that fills)")
    parser.add_argument("--verbose", action="store_true", help="print what the page shows at every look")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for a full picture")
    args = parser.parse_args()
    # A class of 30 on a small engine: 16 run, the rest queue; a 64-token budget chunks the prefills.
    server_args = ("--prefix-caching", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                   "--kv-memory", args.kv_memory)
    with launcher.serve_in_subprocess(args.model, engine=ENGINE, device="cpu", args=server_args) as url:
        warm_prefix_cache(url)
        time.sleep(FINISHED_KEEP_S + 1)   # that request has left the page when the class arrives
        driver = browser(args.dark)
        try:
            driver.get(url + "/")
            traffic = class_traffic(url, args.students)
            deadline, best = time.monotonic() + args.timeout, None
            while traffic.is_alive() and time.monotonic() < deadline:
                c = page_counts(driver)
                if args.verbose:
                    print(f"  {time.strftime('%H:%M:%S')} {c}", flush=True)
                # The picture to keep: a full batch decoding, a queue behind it, finished requests,
                # shared prefix blocks, and chunked prefills or preemptions if the moment shows them;
                # among equals, the one with the most rows.
                score = (2 * (c["decode"] >= 12) + (c["waiting"] > 0) + 2 * (c["finished"] > 0) + (c["shared"] > 0) +
                         (c["prefill"] > 0) + (c["preempted"] > 0), c["rows"])
                if best is None or score > best:
                    best = score
                    save(driver, args.out)
                    print(f"[screenshot] {c} -> {args.out}", flush=True)
                    if score[0] >= 7:
                        break
                time.sleep(0.25)
            if traffic.error is not None:
                raise SystemExit(f"the class's requests failed: {traffic.error!r}")
            print(f"[screenshot] kept the picture scoring {best[0]} of 8; the class's requests "
                  f"{'still run' if traffic.is_alive() else 'ended'}", flush=True)
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
