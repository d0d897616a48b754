"""A run's preflight: every check that can fail without loading a model or writing a file, run by
`grpoflow train` before a flow run is even created and by the flow itself (a deployment's run has no
CLI before it). A CLI run checks once: it hands its result to the flow (`preflighted`), which then
checks again only a config or resume that differs from the one checked (the MCP and verifiers checks
reach servers, and ran twice per CLI run before).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from grpoflow.flows.config import ConfigError, GRPOConfig, where_searched
from grpoflow.flows.training.data import confine_dataset, load_rows, split_rows
from grpoflow.flows.training.environments import check_environment_rows, check_run
from grpoflow.flows.training.runs import check_lora_targets, check_model_dir
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.allowlist import (
    NotAllowedError,
    check_path,
    check_server,
    check_server_flags,
    enforced,
)
from grpoflow.tasks.models import is_template_text

# (the checked config and resume, as JSON; the rows preflight returned) while a CLI runs its flow
_PREFLIGHTED: ContextVar[tuple[str, list[dict[str, Any]]] | None] = ContextVar(
    "grpoflow_preflighted", default=None
)


def _key(cfg: GRPOConfig, resume: str | None) -> str:
    return json.dumps([cfg.model_dump(mode="json"), resume], sort_keys=True, default=str)


@contextlib.contextmanager
def preflighted(cfg: GRPOConfig, resume: str | None, rows: list[dict[str, Any]]) -> Iterator[None]:
    """Within the block, `preflight` of this same config and resume returns `rows` without checking
    again (the flow a CLI command runs, after the command checked it)."""
    token = _PREFLIGHTED.set((_key(cfg, resume), rows))
    try:
        yield
    finally:
        _PREFLIGHTED.reset(token)


def preflight(cfg: GRPOConfig, resume: str | None = None) -> list[dict[str, Any]]:
    """Every check that can fail without loading a model or writing a file; returns the training rows
    (the dataset less its eval split).

    Run by `grpoflow train` before a flow run is even created, and again by the flow (deployments);
    inside `preflighted` of the same config and resume, the flow's call returns the CLI's rows.
    """
    done = _PREFLIGHTED.get()
    if done is not None and done[0] == _key(cfg, resume):
        return done[1]
    confine(cfg)  # worker-started runs: paths, servers and server flags inside the worker's allow-lists
    check_run(cfg)  # reward / tool / environment / generator import paths, environments, MCP, verifiers
    check_reward_models(cfg)
    if cfg.run.report_to:
        from grpoflow.flows.viewing.tracking import (
            check_trackers,  # each tracker's library only when it is named
        )

        check_trackers(cfg)
    rows, held = split_rows(cfg, load_rows(cfg))
    check_environment_rows(cfg, rows + held)  # TRL's dict form: each row names its environment
    if cfg.run.eval_every and not held:
        raise ConfigError(
            f"run.eval_every: the eval split holds no rows ({_eval_source(cfg)}); nothing to score"
        )
    check_lora_installed(cfg)
    if cfg.model.chat_template is not None:
        from grpoflow.tasks.models import template_text

        try:
            template_text(cfg.model.chat_template)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
    if cfg.model.path != "tiny":
        if not Path(cfg.model.path).exists():
            raise ConfigError(f"model.path: not found: {where_searched(cfg, cfg.model.path)}")
        check_model_dir(Path(cfg.model.path))
        check_lora_targets(cfg, Path(cfg.model.path))  # the tiny model's: once it is built
    store = RolloutStore(Path(cfg.storage.root))
    if resume is not None:
        try:
            validate_run_id(resume)
        except ValueError as e:
            raise ConfigError(f"--resume: {e}") from None
        if store.read_run_meta(resume) is None:
            raise ConfigError(f"--resume: no run {resume!r} under {cfg.storage.root}")
    elif cfg.run.run_id and store.read_run_meta(cfg.run.run_id) is not None:
        raise ConfigError(f"run.run_id: run {cfg.run.run_id!r} already exists; use --resume {cfg.run.run_id}")
    return rows


def _eval_source(cfg: GRPOConfig) -> str:
    d = cfg.data
    if d.eval_path:
        return f"data.eval_path {d.eval_path}"
    if d.eval_generator_kwargs is not None:
        return f"data.eval_generator_kwargs {d.eval_generator_kwargs}"
    return f"data.eval_split {d.eval_split}" if d.eval_split else f"data.eval_fraction {d.eval_fraction}"


def check_reward_models(cfg: GRPOConfig) -> None:
    """Each `rewards[i].model` must be a sequence-classification model directory (read from its config
    alone: no weights are loaded here)."""
    from grpoflow.tasks.rewards.reward_model import RewardModelError, check_reward_model

    for i, r in enumerate(cfg.rewards):
        if r.model is None:
            continue
        try:
            check_reward_model(r.model)
        except RewardModelError as e:
            raise ConfigError(f"rewards[{i}].model: {e}") from None


def check_lora_installed(cfg: GRPOConfig) -> None:
    """learner.lora needs peft, an optional extra."""
    import importlib.util

    if cfg.learner.lora is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "learner.lora: LoRA needs peft, which is not installed: pip install 'grpoflow[lora]' "
            "(make install installs it)"
        )


def confine(cfg: GRPOConfig, **servers: str | None) -> None:
    """Refuse, before any file is read or request sent, what the worker's settings do not allow
    (tasks/config/allowlist.py); server flags that undo grpoflow's own safety defaults are refused always.
    `servers`: a flow's own server parameters (name=url), bounded like `inference.url`."""
    try:
        for name, url in servers.items():
            if url:
                check_server(url, name)
        check_server_flags(cfg.inference.extra_args)
        if not enforced():
            return
        if cfg.data.path:
            check_path(cfg.data.path, "data.path")
        if cfg.data.eval_path:
            check_path(cfg.data.eval_path, "data.eval_path")
        if cfg.data.dataset is not None:
            confine_dataset(cfg.data.dataset)
        if cfg.model.path != "tiny":
            check_path(cfg.model.path, "model.path")
        if cfg.model.chat_template is not None and not is_template_text(cfg.model.chat_template):
            check_path(cfg.model.chat_template, "model.chat_template")
        for i, r in enumerate(cfg.rewards):
            if r.model is not None:
                check_path(r.model, f"rewards[{i}].model")
        check_path(cfg.storage.root, "storage.root")
        _confine_trackers(cfg)
        if cfg.inference.url:
            check_server(cfg.inference.url, "inference.url")
        for i, url in enumerate(cfg.inference.urls):
            check_server(url, f"inference.urls[{i}]")
        ray = cfg.scale.ray_address
        if ray and ray != "local":  # a cluster of its own: listed as ray://host:port ('host:port' given)
            check_server(ray if "://" in ray else f"ray://{ray}", "scale.ray_address")
    except NotAllowedError as e:
        raise ConfigError(str(e)) from None


def _confine_trackers(cfg: GRPOConfig) -> None:
    """A worker-started run's trackers: an MLflow server is a server like any other, a local MLflow
    store a path; W&B online sends the run off the machine, to no server a worker allowed."""
    t = cfg.tracking
    if "mlflow" in cfg.run.report_to and t.mlflow_tracking_uri:
        uri = t.mlflow_tracking_uri
        if uri.startswith(("http://", "https://")):
            check_server(uri, "tracking.mlflow_tracking_uri")
        else:  # file:///dir, sqlite:///file.db, or a plain directory
            check_path(uri.split(":///", 1)[-1] if ":///" in uri else uri, "tracking.mlflow_tracking_uri")
    if "wandb" in cfg.run.report_to and t.wandb_mode == "online":
        raise NotAllowedError(
            "tracking.wandb_mode: online sends the run to W&B's servers, which a worker-started run may not "
            "contact; use offline (the default) and wandb sync"
        )
