"""What a `train()` call sets up around the flow in the caller's process (a script, a notebook kernel):
the progress bar, quieter logs, the kernel's event loop set aside, and the explorer on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any


def checkpointed(root: str, run_id: str | None) -> int:
    """The steps a resume of `run_id` starts after (0 for a new run)."""
    from grpoflow.storage.checkpoints import CheckpointStore

    steps = CheckpointStore(root).list(run_id) if run_id is not None else []
    return max(steps) + 1 if steps else 0


@contextlib.contextmanager
def no_running_loop():
    """A Jupyter cell runs inside the kernel's event loop, and the flow's steps call asyncio.run, which
    refuses to nest: the loop is blocked in this cell until train() returns anyway, so it is set aside
    for the run and put back after."""
    loop = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    try:
        yield
    finally:
        asyncio._set_running_loop(loop)


@contextlib.contextmanager
def quiet(on: bool):
    """With a progress bar, Prefect's per-run lines and transformers' own bars (loading, saving the
    weights) go quiet; warnings and errors still show."""
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")] if on else []
    levels = [lg.level for lg in loggers]
    bars = on and hf_logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    if bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def progress(args: Any, steps: int, run_id: str, done: int):
    """A progress bar of the run's steps (a notebook widget in Jupyter), unless disable_tqdm; a resumed
    run's starts at the steps its checkpoint holds."""
    if args.disable_tqdm:
        yield None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, initial=done, desc=run_id, unit="step")
    try:
        yield bar
    finally:
        bar.close()


def start_explorer(root: str, port: int) -> str:
    """The explorer on a daemon thread with its own event loop; its base URL."""
    from grpoflow.flows.viewing.ui import serve

    ready: dict[str, str] = {}
    up = threading.Event()

    def on_ready(url: str) -> None:
        ready["url"] = url
        up.set()

    def run() -> None:
        try:
            asyncio.run(serve(root, port=port, ready=on_ready))
        except BaseException as e:  # surfaced to the caller below
            ready["error"] = repr(e)
            up.set()

    threading.Thread(target=run, name="grpoflow-explorer", daemon=True).start()
    up.wait(60)
    if "url" not in ready:
        raise RuntimeError(f"the explorer did not start: {ready.get('error', 'no answer in 60 s')}")
    return ready["url"]
