"""Reward functions for the process-executor tests: pool workers import them by path."""

from __future__ import annotations

import os
import time
from pathlib import Path


def length(completions: list[str], seconds: float = 0.0, **_) -> list[float]:
    time.sleep(seconds)
    return [float(len(c)) for c in completions]


def hang_forever(completions: list[str], pid_dir: str, **_) -> list[float]:
    """Never returns; leaves its worker's pid in `pid_dir` so a test can check the worker was killed."""
    Path(pid_dir, str(os.getpid())).touch()
    while True:
        time.sleep(3600)


def raises_timeout(completions: list[str], **_) -> list[float]:
    raise TimeoutError("my message")
