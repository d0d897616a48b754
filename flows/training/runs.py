"""Run bookkeeping for flows: preflight, model preparation, open/resume a run (the rows:
flows/training/data.py).

Everything here fails early with a message naming the config field, row or path, before any model
is loaded and before anything is written to the store.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpoflow.flows.config import ConfigError, GRPOConfig, where_searched
from grpoflow.flows.training.data import confine_dataset, load_rows, split_rows
from grpoflow.flows.training.environments import check_environment_rows, check_run
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.allowlist import (
    NotAllowedError,
    check_path,
    check_server,
    check_server_flags,
    enforced,
)
from grpoflow.tasks.learner.learner_api import ADAPTER_DIR, MODEL_DIR
from grpoflow.tasks.models import is_template_text

if TYPE_CHECKING:
    from grpoflow.tasks.learner.learner_api import PolicyLearner
    from grpoflow.tasks.rollouts.replicas import ReplicaSet
    from grpoflow.tasks.steps import RolloutJob


@dataclass
class RunState:
    """Where a run starts (or continues) from."""

    run_id: str
    start_step: int  # first step this invocation trains
    policy_version: int  # version of the weights the learner starts with
    model_path: str  # weights the learner loads and the servers start with (base model or checkpoint/model)
    base_model: str  # the run's original model dir (reference model, tokenizer)
    checkpoint: Path | None  # checkpoint dir resumed from
    resumed: bool
    adapter: str | None = None  # learner.lora: the checkpoint's adapter the learner continues


def preflight(cfg: GRPOConfig, resume: str | None = None) -> list[dict[str, Any]]:
    """Every check that can fail without loading a model or writing a file; returns the training rows
    (the dataset less its eval split).

    Run by `grpoflow train` before a flow run is even created, and again by the flow (deployments).
    """
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


def check_lora_targets(cfg: GRPOConfig, model: Path) -> None:
    """learner.lora.target_modules must name linear layers of `model` (read from its config alone)."""
    if cfg.learner.lora is None:
        return
    from grpoflow.tasks.learner.lora import LoraTargetError, check_targets

    try:
        check_targets(model, cfg.learner.lora)
    except LoraTargetError as e:
        raise ConfigError(str(e)) from None


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


def prepare_model(cfg: GRPOConfig) -> Path:
    """The model a run starts from: `model.path` ('tiny' builds the tiny random model once under
    <root>/models/tiny), after the `warmup` section's SFT when it has steps."""
    if cfg.model.path == "tiny":
        base = Path(cfg.storage.root) / "models" / "tiny"
        if not (base / "config.json").is_file():
            from grpoflow.tasks.tiny_model import build_tiny_model

            build_tiny_model(base, seed=cfg.run.seed)
    else:
        base = check_model_dir(Path(cfg.model.path))
    check_lora_targets(cfg, base)  # before any server starts or warm-up runs
    if cfg.model.chat_template is not None:  # the run's model dir carries the template everywhere
        from grpoflow.tasks.models import with_chat_template

        base = with_chat_template(base, cfg.model.chat_template, cfg.storage.root)
    return warmed_model(cfg, base) if cfg.warmup.steps else base


def warmed_model(cfg: GRPOConfig, base: Path) -> Path:
    """`base` after the warm-up, cached under <root>/models/warmup-<key>: the key covers the base
    model's weights file, the warm-up and tools settings and the seed, so any change warms up anew
    and a resumed run finds the model it started from."""
    from grpoflow.tasks.warmup import callable_name, warm_up

    weights = sorted(base.glob("*.safetensors")) or sorted(base.glob("*.bin"))
    key = {
        "base": str(base.resolve()),
        "weights": [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights],
        "warmup": {
            **cfg.warmup.model_dump(exclude={"examples"}),
            "examples": callable_name(cfg.warmup.examples),
        },
        "tools": [callable_name(t) for t in cfg.tools.tools],
        "environment": callable_name(cfg.tools.environment),
        "describe_tools": cfg.tools.describe_tools,
        "seed": cfg.run.seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(cfg.storage.root) / "models" / f"warmup-{digest}"
    if not (out / "warmup.json").is_file():
        warm_up(base, out, cfg.warmup, cfg.tools, seed=cfg.run.seed)
    return out


def check_model_dir(p: Path) -> Path:
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path: {p} is not a model directory (no config.json)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"model.path: {p} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return p


def new_run_id() -> str:
    return datetime.now(UTC).strftime("grpo-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def open_run(cfg: GRPOConfig, resume: str | None, base_model: Path) -> RunState:
    """Start a new run or continue `resume` from its latest complete checkpoint."""
    root = Path(cfg.storage.root)
    store = RolloutStore(root)
    if resume is None:
        run_id = cfg.run.run_id or new_run_id()
        if store.read_run_meta(run_id) is not None:
            raise ConfigError(f"run.run_id: run {run_id!r} already exists; use --resume {run_id}")
        return RunState(run_id, 0, 0, str(base_model), str(base_model), None, False)
    run_id = validate_run_id(resume)
    meta = store.read_run_meta(run_id)
    if meta is None:
        raise ConfigError(f"--resume: no run {run_id!r} under {root}")
    ckpt = CheckpointStore(root).latest(run_id)
    if ckpt is None:  # killed before the first checkpoint: start over, same run id
        store.delete_steps_after(run_id, -1)
        return RunState(run_id, 0, 0, str(base_model), str(base_model), None, True)
    state = CheckpointStore(root).load_state(ckpt)
    last = int(state["step"])
    adapter = _checkpoint_adapter(cfg, ckpt)
    # Steps after the checkpoint are redone: remove their files so no row is counted twice.
    store.delete_steps_after(run_id, last)
    return RunState(
        run_id=run_id,
        start_step=last + 1,
        # A checkpoint after step s holds weights with s + 1 updates: that is their version, whatever
        # was last pushed (with sync_every > 1 the server may have been behind).
        policy_version=last + 1,
        # LoRA: the base model again (the servers start with it), the adapter continued on it.
        model_path=str(base_model) if adapter else str(ckpt / MODEL_DIR),
        base_model=str(base_model),
        checkpoint=ckpt,
        resumed=True,
        adapter=adapter,
    )


def _checkpoint_adapter(cfg: GRPOConfig, ckpt: Path) -> str | None:
    """The adapter a LoRA checkpoint holds (None for a full model's); a resume must train what the
    checkpoint holds."""
    adapter = ckpt / ADAPTER_DIR
    if adapter.is_dir() != (cfg.learner.lora is not None):
        held = "a LoRA adapter" if adapter.is_dir() else "a full model"
        raise ConfigError(
            f"learner.lora: the checkpoint {ckpt} holds {held}; resume it with learner.lora "
            f"{'set as the run had it' if adapter.is_dir() else 'unset'}"
        )
    return str(adapter) if adapter.is_dir() else None


def write_meta(cfg: GRPOConfig, run: RunState, status: str, **extra: Any) -> None:
    """Record config, status and lineage in <root>/runs/<run>.json (merged, atomic)."""
    store = RolloutStore(Path(cfg.storage.root))
    meta = store.read_run_meta(run.run_id) or {"created_at": datetime.now(UTC).isoformat()}
    meta.update(
        {
            "run_id": run.run_id,
            "status": status,
            "updated_at": datetime.now(UTC).isoformat(),
            "config": cfg.model_dump(mode="json", fallback=_import_path_of),
            "base_model": run.base_model,
        }
    )
    for k, v in extra.items():
        if k == "flow_run_id" and v:
            meta.setdefault("flow_runs", [])
            if v not in meta["flow_runs"]:
                meta["flow_runs"].append(v)
        else:
            meta[k] = v
    store.write_run_meta(run.run_id, meta)


def build_learner(cfg: GRPOConfig, run: RunState) -> PolicyLearner:
    """The run's learner on its sections, resumed from the run's checkpoint if it has one. With
    `learner.world_size` > 1 its ranks run on the run's Ray cluster (tasks/learner/distributed.py)."""
    # torch is imported here, not at the top: preflight and the CLI use this module without a model.
    from grpoflow.tasks.learner.learn import Learner
    from grpoflow.tasks.learner.learner_api import LearnerRun

    kind = Learner
    if cfg.learner.world_size > 1:
        from grpoflow.tasks.learner.distributed import DistributedLearner as kind
    learner = kind(
        run.model_path,
        cfg.learner,
        cfg.algorithm,
        LearnerRun(
            cfg.run.steps,
            cfg.run.seed,
            ref_model_path=run.base_model,
            tokenizer_path=run.base_model,
            adapter_path=run.adapter,
        ),
        cfg.generation,
        cfg.model,
    )
    if run.checkpoint is not None:
        try:
            learner.load_trainer_state(run.checkpoint)
        except BaseException:
            learner.close()
            raise
    return learner


def rollout_job(
    cfg: GRPOConfig, servers: ReplicaSet, tokenizer_path: str, train_rows: list[dict] | None = None
) -> RolloutJob:
    """What each step's rollout task needs: the servers it generates on, and the config's sections;
    `train_rows`: the training split (its size is an epoch; dynamic sampling draws from it)."""
    from grpoflow.tasks.rollouts.sampling import DynamicSampling
    from grpoflow.tasks.steps import RolloutJob  # Prefect's import stays out of preflight's path

    sampling = None
    if cfg.algorithm.dynamic_sampling and train_rows:
        sampling = DynamicSampling(
            train_rows, cfg.data.prompts_per_step, cfg.run.seed, cfg.algorithm.max_sampling_rounds
        )

    return RolloutJob(
        tokenizer_path=tokenizer_path,
        generation=cfg.generation,
        tools=cfg.tools,
        rewards=cfg.rewards,
        inference=cfg.inference,
        seed=cfg.run.seed,
        servers=servers,
        max_steps=cfg.run.steps,
        rows_per_epoch=len(train_rows or []),
        sampling=sampling,
    )


def checkpoint_state(cfg: GRPOConfig, run_id: str, step: int, version: int) -> dict[str, Any]:
    """What a resume needs beside the weights and optimizer: where the policy stands. (Where the data
    stands follows from the step: the sampler is a function of the seed and the step.)"""
    return {"step": step, "policy_version": version, "run_id": run_id}


def _import_path_of(obj: Any) -> str:
    """How a callable given from Python (a reward, tool or environment) is recorded in run metadata."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
