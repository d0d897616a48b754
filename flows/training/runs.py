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

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.learner.learner_api import ADAPTER_DIR, MODEL_DIR

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


def check_lora_targets(cfg: GRPOConfig, model: Path) -> None:
    """learner.lora.target_modules must name linear layers of `model` (read from its config alone)."""
    if cfg.learner.lora is None:
        return
    from grpoflow.tasks.learner.lora import LoraTargetError, check_targets

    try:
        check_targets(model, cfg.learner.lora)
    except LoraTargetError as e:
        raise ConfigError(str(e)) from None


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
