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


def logs_lengths(completions: list[str], trainer_state, log_extra, log_metric, **_) -> list[float]:
    """Scores lengths, logs each one as a column and their sum and the step as metrics (TRL's keywords)."""
    lengths = [float(len(c)) for c in completions]
    log_extra("length", lengths)
    log_metric("total", sum(lengths))
    log_metric("step_seen", float(trainer_state.global_step))
    return lengths
