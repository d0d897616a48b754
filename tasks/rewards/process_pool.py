"""The process pool of `executor: process` rewards, and what happens when a reward hangs in it.

One long-lived pool: spawning interpreters per batch would cost seconds. A call the caller gave up on
(its timeout) may hold its worker for good, so the pool is then replaced and its workers killed; the
calls that broke with it are retried once on the new pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from grpoflow.storage.processes import identity, is_alive, watch_parent


def _worker_started(parent_pid: int, started: Any) -> None:
    """Each worker's initializer: its parent watchdog, and its identity reported to the pool."""
    # a worker stuck in a hung reward never reads its queue again, so it would outlive a killed run:
    # the watchdog ends it once its parent is gone
    watch_parent(parent_pid)
    started.put(identity())


class RewardProcessPool(cf.ProcessPoolExecutor):
    """A 'spawn' process pool whose workers report their identities as they start, so that a hung one
    can be killed. Python 3.11 has no public way to end an executor's workers (3.14 adds
    `kill_workers`) and its process handles are private, so the pool keeps its own record."""

    def __init__(self, max_workers: int):
        # 'spawn', because forking a process that holds torch threads and an event loop is unsafe.
        context = mp.get_context("spawn")
        self.started = context.SimpleQueue()  # the identity of every worker started so far
        super().__init__(
            max_workers=max_workers,
            mp_context=context,
            initializer=_worker_started,
            initargs=(os.getpid(), self.started),
        )

    def kill_started_workers(self) -> None:
        """SIGKILL every worker that has started and still runs (never a pid reused since)."""
        while not self.started.empty():
            worker = self.started.get()
            if is_alive(worker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker["pid"], signal.SIGKILL)


_PROCESS_POOL: RewardProcessPool | None = None
_POOL_LOCK = threading.Lock()


def process_pool() -> RewardProcessPool:
    """The shared pool, started at its first use (and again after a recycle)."""
    global _PROCESS_POOL
    with _POOL_LOCK:
        if _PROCESS_POOL is None:
            _PROCESS_POOL = RewardProcessPool(max_workers=2)
        return _PROCESS_POOL


def _recycle_process_pool(pool: RewardProcessPool) -> None:
    """Stop handing out `pool` and kill its workers: a hung reward would otherwise hold one forever."""
    global _PROCESS_POOL
    with _POOL_LOCK:
        if _PROCESS_POOL is not pool:
            return  # recycled already, by another call that saw it break
        _PROCESS_POOL = None
    # The executor sees its workers die and fails every call still on it with BrokenProcessPool
    # (retried once).
    pool.kill_started_workers()
    pool.shutdown(wait=False)


async def in_process_pool(call: Callable[[], Any]) -> Any:
    """Run `call()` (a picklable partial) in the shared process pool, recycling the pool when a call
    is stuck.

    Cancellation (the caller's timeout) means our worker may be stuck in user code for good, so the
    pool is replaced and its workers killed. A call broken by that (another reward's or batch's
    hang) or by a crashed worker is retried once on the new pool, under the caller's same deadline,
    so a good reward is not failed by someone else's hang.
    """
    loop = asyncio.get_running_loop()
    for attempt in range(2):
        pool = process_pool()
        try:
            fut = loop.run_in_executor(pool, call)
        except RuntimeError:  # broken, or shut down by a recycle between lookup and submit
            _recycle_process_pool(pool)
            if attempt:
                raise
            continue
        try:
            return await fut
        except BrokenProcessPool:
            _recycle_process_pool(pool)
            if attempt:
                raise
        except asyncio.CancelledError:
            _recycle_process_pool(pool)
            raise
    raise AssertionError("unreachable")
