"""Blocking calls on daemon threads: user code (sync tools and reward functions), and calls to a
server that may not answer (`call_within`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any


async def in_daemon_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` on its own daemon thread and await the result.

    Unlike `asyncio.to_thread` or a ThreadPoolExecutor, a call that never returns (a hung tool or reward
    function) is abandoned once its caller's timeout fires: it blocks neither `asyncio.run`'s executor
    shutdown nor interpreter exit, so one bad function can never stall a step or a run.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    ctx = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():  # cancelled by a timeout: nobody wants the late result
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            value, ok = ctx.run(fn, *args, **kwargs), True
        except BaseException as e:  # handed to the awaiting coroutine, which classifies it
            value, ok = e, False
        with contextlib.suppress(RuntimeError):  # a closed loop: its caller gave up long ago
            loop.call_soon_threadsafe(settle, ok, value)

    name = f"grpoflow-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=target, name=name, daemon=True).start()
    return await fut


def call_within(timeout_s: float, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on its own daemon thread (this context's copy), waited for at most
    `timeout_s`: past it, TimeoutError, and the call is abandoned (it blocks no exit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    ctx = contextvars.copy_context()

    def target() -> None:
        try:
            done.set_result(ctx.run(fn, *args, **kwargs))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=target, name=f"grpoflow-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{getattr(fn, '__name__', 'call')} took more than {timeout_s:g} s") from None


def run_blocking(coro: Any) -> Any:
    """`coro`'s result, from sync code, also inside a running event loop (then on a helper thread's own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as ex:
        return ex.submit(asyncio.run, coro).result()
