"""The base of every config section, and the import-path check the sections share.

The sections themselves live beside this module, one module per subsystem that reads them (model.py,
data.py, rollouts.py, rewards.py, algorithm.py, learner.py, inference.py, run.py); the names a field
picks from live in choices.py. Each unit takes its own section (the learner its `LearnerConfig` and
`AlgorithmConfig`, generation its `GenerationConfig` and `ToolsConfig`, scoring its `RewardConfig`s);
only flows see the whole tree (`flows.config.GRPOConfig`), which assembles these sections and
validates across them.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """The base of every config section and of the whole tree: unknown keys (typos) are errors, and
    so is an assignment of a bad value after validation (`cfg.learner.lr = -1`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_import_path_syntax(v: str) -> str:
    if ":" not in v or not all(v.split(":", 1)):
        raise ValueError(f"expected an import path 'module:attribute', got {v!r}")
    return v


def check_sendable(obj: Any, field: str, executor: str) -> None:
    """A callable given from Python that runs in another process (`executor` 'process' or 'ray') must be
    importable there by its module and name: one defined in `__main__` (a script, a notebook cell), a
    lambda or a closure is not. An async function always runs in this process, whatever the executor."""
    if isinstance(obj, str) or executor == "thread" or inspect.iscoroutinefunction(obj):
        return
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", type(obj).__qualname__)
    name = getattr(obj, "__name__", qualname)
    where = (
        "is defined in __main__ (a script or a notebook)"
        if module == "__main__"
        else "is a lambda or a closure"
        if "<lambda>" in qualname or "<locals>" in qualname
        else None
    )
    if where is not None:
        raise ValueError(
            f"{field}: {name} {where}, and executor {executor!r} runs it in another process, which cannot "
            "import it: move it into a module of its own, or use executor 'thread' (this process)"
        )
