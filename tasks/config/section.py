"""The base of every config section, and the import-path check the sections share.

The sections themselves live beside this module, one module per subsystem that reads them (model.py,
data.py, rollouts.py, rewards.py, algorithm.py, learner.py, inference.py, run.py); the names a field
picks from live in choices.py. Each unit takes its own section (the learner its `LearnerConfig` and
`AlgorithmConfig`, generation its `GenerationConfig` and `ToolsConfig`, scoring its `RewardConfig`s);
only flows see the whole tree (`flows.config.GRPOConfig`), which assembles these sections and
validates across them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """The base of every config section and of the whole tree: unknown keys (typos) are errors, and
    so is an assignment of a bad value after validation (`cfg.learner.lr = -1`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_import_path_syntax(v: str) -> str:
    if ":" not in v or not all(v.split(":", 1)):
        raise ValueError(f"expected an import path 'module:attribute', got {v!r}")
    return v
