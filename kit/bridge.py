"""kit/bridge.py - blocking engines under an asyncio server.

The engines are plain Python: `generate` blocks for seconds and `generate_stream` is a
blocking iterator. The server is asyncio: one event loop serves every connection. These
three helpers join the two without stalling the loop or leaking work:

- `run_ahead` drives a blocking iterator from its own thread, a token ahead of the sender;
- `in_thread` runs one blocking call, and lets a cancellation through only once it is over;
- `until_disconnected` cancels a request's work when its client hangs up;
- `all_or_nothing` awaits several answers together and drops all of them if one fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from minivllm import threads as cpu_threads
from kit.openai_api import APIError


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
        # A generator cannot be closed while its thread runs it, but a stream object (Chapter 9's
        # RequestStream) can, from any thread: the request stops now, not after its next token.
        if not inspect.isgenerator(items):
            items.close()
        with anyio.CancelScope(shield=True):   # a cancellation must not skip the clean-up
            await run_in_threadpool(producer.join)
# --8<-- [end:run-ahead]


# --8<-- [start:in-thread]
async def in_thread(fn: Callable, *args):
    """fn(*args) in a worker thread, so that the event loop keeps serving meanwhile.

    A thread cannot be stopped from outside. When the caller is cancelled (its client hung
    up, or it ran past --request-timeout), asyncio would stop waiting at once while the
    thread computes on; whoever then took the engine's turn would start a second generation
    beside the first. So the cancellation waits for the thread, and only then goes on.
    """
    call = asyncio.ensure_future(run_in_threadpool(fn, *args))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            await asyncio.wait({call})
        raise
# --8<-- [end:in-thread]


async def all_or_nothing(awaitables) -> list:
    """asyncio.gather, except that the first failure cancels the others (their answer is not
    sent), and that it returns only once they are over, their clean-up included."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)
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
