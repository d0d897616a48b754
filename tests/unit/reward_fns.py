"""Reward functions the tests name by import path: pool workers import them, and runs configure them."""

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


def trl_docs_length(completions, log_metric=None, **kwargs) -> list[float]:
    """Written as TRL's documentation writes reward functions: each completion a list of messages.
    Logs its batch's mean length (log_metric)."""
    lengths = [len(c[0]["content"]) for c in completions]
    if log_metric is not None:
        log_metric("mean_chars", sum(lengths) / len(lengths))
    return [min(n, 50) / 50 for n in lengths]


def letters_on_every_third_row(completions: list[str], id: list[int], **_) -> list[float]:
    """The fraction of letters "a" on rows whose id is a multiple of 3, and 0.0 on every other row: the
    other rows' groups never have reward variance, whatever the model writes (dynamic sampling's test)."""
    return [
        c.lower().count("a") / max(1, len(c)) if i % 3 == 0 else 0.0
        for c, i in zip(completions, id, strict=True)
    ]


def judged_elsewhere(completions, **_) -> list[float | None]:
    """No value for any completion (None: invalid), as a reward whose scores are recorded under other
    names returns: every completion masked, nothing failed."""
    return [None] * len(completions)


def answer_in(completions: list[str], answer: list[str], **_) -> list[float]:
    """1 when the row's `answer` column is in the completion (a column only the dataset has), else 0."""
    return [float(a in c) for c, a in zip(completions, answer, strict=True)]


def fails_on_zzz(completions: list[str], **_) -> list[float]:
    """Raises on a batch that holds a completion with "zzz" (its batch's cells fail); else their lengths."""
    if any("zzz" in c for c in completions):
        raise ValueError("cannot score zzz")
    return [float(len(c)) for c in completions]
