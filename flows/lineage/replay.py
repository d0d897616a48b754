"""grpo-replay (`grpoflow replay RUN [--config OTHER.yaml] [--where "SQL predicate"]`): the learner's half
of a run, again, on RUN's stored groups, with no generation ("would loss B have done better than loss A
on the same rollouts?").

A new run, in RUN's store, starting from RUN's base model, whose step s trains on the groups RUN
stored for step s (those with a completion matching `--where`, a predicate over the `rollouts` view),
in RUN's order. Advantages, masks and importance ratios are computed again under the replay's
`algorithm` and `learner` sections from the stored rewards and behaviour logprobs; the rows land under
the new run id (its rollouts and rewards: RUN's, with the new advantages; its steps: the learner's
figures), so `steps` compares column for column and `grpoflow compare RUN NEW` puts them side by side.
The sections that made the samples (`model`, `data`, `generation`, `tools`, `warmup`) must be RUN's: a
replay that differs there is refused with one line naming the field. The run's record says
`replay_of: RUN`. It checkpoints and resumes as a run does (`grpoflow train --resume` is not for it:
`grpoflow replay RUN --resume NEW`), and pushes no weights: nothing is served.

With RUN's own config a replay's weights are RUN's bit for bit (on the machine and threads RUN used),
also when RUN generated ahead: the learner sees the same samples in the same order.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.training.runner import StepRunner, StepUnits
from grpoflow.flows.training.runs import RunState, build_learner, open_run, prepare_model, write_meta
from grpoflow.flows.training.step_close import StepClose
from grpoflow.storage.compact import BackgroundCompactor
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from grpoflow.tasks.advantages import assign_advantages
from grpoflow.tasks.rewards.score import reward_metrics
from grpoflow.tasks.steps import RolloutBatch

# The sections that made RUN's samples: a replay trains on those samples, so they must be RUN's.
SAMPLE_SECTIONS = ("model", "data", "generation", "tools", "warmup")


def replay_config(source: GRPOConfig, other: GRPOConfig | None, run_id: str, source_id: str) -> GRPOConfig:
    """The replay's config: `other` (default: RUN's own) in RUN's store, with the run id `run_id`; a
    ConfigError naming the first field of SAMPLE_SECTIONS where it differs from RUN's."""
    cfg = other or source
    for section in SAMPLE_SECTIONS:
        ours, theirs = (
            _flat(getattr(cfg, section).model_dump(mode="json")),
            _flat(getattr(source, section).model_dump(mode="json")),
        )
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                raise ConfigError(
                    f"{section}.{key}: the replay's {ours.get(key)!r} is not run {source_id}'s "
                    f"{theirs.get(key)!r}; a replay trains on {source_id}'s samples, so what made them stays"
                )
    return cfg.model_copy(
        update={"storage": source.storage, "run": cfg.run.model_copy(update={"run_id": run_id})}
    )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class StoredBatches:
    """RUN's stored groups, a step at a time, as the step loop takes batches from generation: the groups
    of that step with a completion matching `where` (all of them without it), in RUN's order."""

    restarts = 0

    def __init__(self, cfg: GRPOConfig, source_id: str, where: str | None):
        self.source_id, self.rewards = source_id, cfg.rewards
        self.store = RolloutStore(Path(cfg.storage.root))
        self.keep: set[tuple[int, str]] | None = None  # (step, group id) of the groups `where` picks
        if where is not None:  # one query for every step
            _, rows = query(
                cfg.storage.root,
                f"SELECT DISTINCT step, group_id FROM rollouts WHERE run_id = $run AND split = 'train' AND ({where})",
                {"run": source_id},
            )
            self.keep = set(rows)

    def next_batch(self, step: int) -> RolloutBatch:
        groups = self.store.read_groups(self.source_id, step, split="train")
        if not groups:
            raise ConfigError(f"run {self.source_id} stored no training groups for step {step}")
        if self.keep is not None:
            groups = [g for g in groups if (step, g.group_id) in self.keep]
        return RolloutBatch(step, groups, reward_metrics(groups, self.rewards))

    def to_keep(self) -> list[RolloutBatch]:
        return []  # a resume reads the store again


def plan(
    run: str,
    config: GRPOConfig | None = None,
    sets: list[str] | None = None,
    where: str | None = None,
    replay_id: str | None = None,
    resume: str | None = None,
    root: str | None = None,
) -> tuple[GRPOConfig, GRPOConfig]:
    """(the replay's config, the source run's): every check of grpo-replay's input, made before anything
    starts (the CLI calls it before the flow run, the flow again); bad input is a ConfigError or
    QueryError naming the field, run or predicate."""
    store_root = Path(root or (config.storage.root if config else "runs"))
    source_id = validate_run_id(run)
    meta = RolloutStore(store_root).read_run_meta(source_id)
    if meta is None:
        raise ConfigError(f"RUN: no run {source_id!r} under {store_root}")
    recorded = {**meta["config"], "storage": {**meta["config"].get("storage", {}), "root": str(store_root)}}
    source = GRPOConfig.model_validate(recorded)
    if sets:
        config = load_config(None, sets, base=config.model_dump(mode="json") if config else recorded)
    replay = validate_run_id(resume or replay_id or f"{source_id}-replay")
    if (had := RolloutStore(store_root).read_run_meta(replay)) is None and resume:
        raise ConfigError(f"--resume: no replay {replay!r} under {store_root}")
    if had is not None and not resume:
        raise ConfigError(f"--run-id: run {replay!r} already exists; name another, or --resume {replay}")
    if had is not None and had.get("replay_of") != source_id:
        raise ConfigError(f"--resume: run {replay!r} is not a replay of {source_id}")
    cfg = replay_config(source, config, replay, source_id)
    stored = RolloutStore(store_root).steps_written("rollouts", source_id)
    if cfg.run.steps > len(stored):
        raise ConfigError(f"run.steps: {cfg.run.steps} steps, and run {source_id} stored {len(stored)}")
    if where is not None:
        query(store_root, f"SELECT count(*) FROM rollouts WHERE ({where})")  # a bad predicate fails now
    return cfg, source


@flow(name="grpo-replay", log_prints=True)
def grpo_replay(
    run: str,
    config: GRPOConfig | None = None,
    sets: list[str] | None = None,
    where: str | None = None,
    replay_id: str | None = None,
    resume: str | None = None,
    root: str | None = None,
) -> dict[str, Any]:
    """Train a new run on run `run`'s stored groups (module doc). `config`: the replay's config (default:
    `run`'s own); `sets`: `key=value` overrides on top of it; `where`: a SQL predicate over `rollouts`
    that picks the groups; `root`: the store (default: the config's `storage.root`); `resume`: a replay
    to continue."""
    cfg, source = plan(run, config, sets, where, replay_id, resume, root)
    base = prepare_model(source)  # the run's base model (its warm-up's, cached in the store)
    state = open_run(cfg, resume, base)
    write_meta(cfg, state, "running", replay_of=run, replay_where=where)
    try:
        summary = _replay(cfg, state, StoredBatches(cfg, run, where))
    except BaseException as e:
        write_meta(cfg, state, "failed" if isinstance(e, Exception) else "cancelled", error=repr(e)[:500])
        raise
    write_meta(cfg, state, "completed", last_step=cfg.run.steps - 1)
    return summary


def _replay(cfg: GRPOConfig, run: RunState, batches: StoredBatches) -> dict[str, Any]:
    """The step loop of grpo-train (flows/training/train.py) with stored batches, and no servers."""
    root, run_id = cfg.storage.root, run.run_id
    compactor = BackgroundCompactor(root, run_id, cfg.storage.compact_every, log=get_run_logger())
    with (
        closing(compactor),
        closing(build_learner(cfg, run)) as learner,
        closing(StepRunner(cfg.run.step_task_runs)) as runner,
        closing(StepUnits(runner, learner, None, None, root=root, run_id=run_id)) as units,
    ):
        close = StepClose(cfg, run, runner, units, batches, compactor, None)
        for step in range(run.start_step, cfg.run.steps):
            rec = runner.begin(step)
            batch = batches.next_batch(step)
            rec.rollout = batch.metrics
            rec.advantages = assign_advantages(
                batch.groups, step=step, algorithm=cfg.algorithm, sync_every=cfg.sync.sync_every
            )
            with runner.recorded(rec):
                written = units.persist(step, batch.groups)
                rec.train = units.update(batch.groups)
                rec.times.write = written()
            rec.policy_version = step + 1
            close.step(step, rec, [])
        return close.finish()
