"""Run-wide settings: the `run` section (length, checkpoints, evaluation, trackers), where it is stored
(`storage`), the Ray cluster it may use (`scale`), and the trackers' settings (`tracking`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from grpoflow.storage.ids import validate_run_id
from grpoflow.tasks.config.choices import TRACKER_NAMES
from grpoflow.tasks.config.section import Section


class ScaleConfig(Section):
    ray_address: str | None = Field(
        None,
        description="Ray cluster for `executor: ray` rewards and tools: None = no Ray; 'local' = start "
        "one on this machine for the run (it dies with the run); else an existing cluster's address "
        "('host:6379', or 'ray://host:10001' for Ray Client).",
    )
    object_store_mb: int = Field(
        256, ge=80, description="Object store cap of a local Ray, in MiB (Ray's minimum is about 76)."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs a local Ray offers to tasks (None: this machine's CPU count)."
    )
    startup_timeout_s: float = Field(120.0, gt=0, description="Wait this long for a local Ray to start.")


class StorageConfig(Section):
    root: str = Field("runs", description="Store root: rollouts, rewards, steps, checkpoints, weights.")
    compact_every: int = Field(
        100,
        ge=0,
        description="Compaction unit: after each checkpoint a background thread merges every full "
        "block of this many closed steps (then 10 such blocks, 100, ...) into one Parquet file per "
        "table, and the rest at the end of the run; SQL then opens a few files instead of one per "
        "step. 0: off (`grpoflow compact` still works). Keep it constant within a run.",
    )


class RunConfig(Section):
    run_id: str | None = Field(None, description="Run name (None: generated); [A-Za-z0-9._-].")
    steps: int = Field(20, ge=1, description="Training steps of this run (total, including resumed).")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept per run.")
    seed: int = Field(0, description="Seed of data order, sampling and initialisation.")
    max_failed_reward_steps: int = Field(
        2,
        ge=0,
        description="Stop the run (non-zero exit, resumable) when a required reward fails (raises, times "
        "out, returns the wrong number of values) on every completion of this many consecutive steps, or "
        "when every completion of this many consecutive steps is masked (no valid value of every required "
        "reward, whatever the cells say); each such step is logged at once. Steps whose groups all had "
        "equal rewards are not masked. 0: never stop.",
    )
    report_to: list[Literal[TRACKER_NAMES]] = Field(
        default_factory=list,
        description="Trackers that get every step's metrics, the config, sample tables and the report's plots "
        "(settings: the `tracking` section). Each is an optional extra: pip install 'grpoflow[tracking]'. "
        "A step reaches them once a checkpoint closes it, so a resume never shows a step twice.",
    )
    log_samples_every: int = Field(
        10,
        ge=0,
        description="With run.report_to: every N steps, a table of the step's rollouts (prompt, completion, "
        "reward, each reward's status, advantage) goes to the trackers. 0: never.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Score the held-out split (data.eval_path / eval_fraction / eval_split) every N steps and "
        "after the last, on the run's servers with grpo-evaluate's seeded sampling: split='eval' rows at the "
        "step, eval/* metrics and eval_seconds in `steps`. A multiple of sync.sync_every. 0: off.",
    )
    eval_prompts: int | None = Field(
        None,
        ge=1,
        description="With run.eval_every: at most this many eval rows, in split order (None: all).",
    )
    reproducible: bool = Field(
        False,
        description="Reruns of this config with the same seed on the same machine and thread settings "
        "give bit-identical rollouts, rewards, advantages, metrics and weights, at any max_staleness and "
        "across a resume: each push first waits for the batches generated ahead (none then changes "
        "weights mid-way; the step's wait is its settle_seconds), and each checkpoint keeps those "
        "batches for a resume instead of generating them again under its weights. One server only. "
        "See docs/reproducibility.md.",
    )
    step_task_runs: bool = Field(
        True,
        description="Show each step's rollout-batch and train-step as Prefect task runs (the UI's "
        "timeline of the pipeline). On a busy 2-core machine each costs a co-located Prefect API server "
        "~0.05 s of CPU and the run ~0.025 s: ~1.3% of a SmolLM2 step, ~18% of the tiny demo's (BENCHMARKS.md). "
        "False: the same work as plain calls; the UI keeps the flow run, its step lines, progress "
        "and tables, and checkpoints and failed writes or pushes are still task runs.",
    )

    @field_validator("run_id")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return None if v is None else validate_run_id(v)


class TrackingConfig(Section):
    """Where the trackers of `run.report_to` write (TensorBoard needs no setting: its event files go to
    <root>/tensorboard/<run>)."""

    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI: an `mlflow server` URL (http://host:5000) or a local store. None: "
        "$MLFLOW_TRACKING_URI, else a local store under <root>/mlflow.",
    )
    mlflow_experiment: str = Field("grpoflow", min_length=1, description="MLflow experiment name.")
    wandb_project: str = Field("grpoflow", min_length=1, description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); None: W&B's default.")
    wandb_mode: Literal["offline", "online"] | None = Field(
        None,
        description="W&B mode. None: $WANDB_MODE, else offline (runs under <root>/wandb; `wandb sync` "
        "uploads them later), since many training machines have no internet.",
    )
    finish_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long the run waits at its end for trackers to take what is queued; a tracker "
        "still busy then (a server down) is left, and a resume logs what it missed.",
    )
