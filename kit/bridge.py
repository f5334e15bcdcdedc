"""kit/bridge.py - blocking engines under an asyncio server.

The engines are plain Python: `generate` blocks for seconds and `generate_stream` is a
blocking iterator. The server is asyncio: one event loop serves every connection. These
three helpers join the two without stalling the loop or leaking work:

- `run_ahead` drives a blocking iterator from its own thread, a token ahead of the sender;
- `until_disconnected` cancels a request's work when its client hangs up;
- `all_or_nothing` runs several answers together and drops all of them if one fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
from collections.abc import AsyncIterator, Iterator

import anyio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from kit.openai_api import APIError

from kit import threads as cpu_threads


# --8<-- [start:run-ahead]
async def run_ahead(items: Iterator) -> AsyncIterator:
    """Drive a blocking iterator from its own thread, so that the engine computes the
    next token while the event loop is still sending the previous one."""
    loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

    def produce() -> None:
        try:
            for item in items:
                loop.call_soon_threadsafe(queue.put_nowait, ("item", item))
                if stop.is_set():      # the client is gone: stop at the next token
                    break
            loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
        except Exception as exc:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
        finally:
            items.close()              # closed by the thread that runs it: stops the engine's work

    producer = threading.Thread(target=produce, daemon=True)
    cpu_threads.release_idle_workers()   # the producer (or the engine's loop) computes, not this thread
    producer.start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        cancel = getattr(items, "cancel", None)
        if cancel is not None:   # a stream that can be stopped from here: do not wait for its next token
            cancel()
        with anyio.CancelScope(shield=True):   # a cancellation must not skip the clean-up
            await run_in_threadpool(producer.join)
# --8<-- [end:run-ahead]


async def all_or_nothing(awaitables) -> list:
    """asyncio.gather, except that the first failure cancels the others: their answer is not sent."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def until_disconnected(request: Request, awaitable):
    """Await the work, but cancel it (its clean-up frees the engine) if the client hangs up first."""
    work = asyncio.ensure_future(awaitable)

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise APIError(499, "the client closed the request")   # nobody reads it; logs see why
    return work.result()
