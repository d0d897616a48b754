"""grpo-train: the pipelined async GRPO loop (docs/architecture.md, section 2).

Generation + scoring of step s+k runs while step s trains (k = max_staleness); weights are pushed
into the running vLLM server every `sync_every` steps; rollouts, rewards and a steps row land in
Parquet every step; checkpoints make the run resumable.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from grpoflow.flows.cluster import ray_cluster
from grpoflow.flows.config import GRPOConfig, load_config
from grpoflow.flows.evaluate import TrainingEval, eval_metrics
from grpoflow.flows.pipeline import RolloutPipeline, replica_set
from grpoflow.flows.progress import StepReporter
from grpoflow.flows.report import write_report
from grpoflow.flows.runner import StepRunner, StepUnits
from grpoflow.flows.runs import (
    RunState,
    build_learner,
    checkpoint_state,
    open_run,
    preflight,
    prepare_model,
    rollout_job,
    write_meta,
)
from grpoflow.flows.serve import inference_servers, replica_names, vllm_python
from grpoflow.flows.tracking import Tracking, tracking
from grpoflow.storage.compact import BackgroundCompactor
from grpoflow.storage.processes import identity
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.push.push import weight_push
from grpoflow.tasks.rewards.broken_rewards import BrokenReward, BrokenRewardError
from grpoflow.tasks.rollouts.reproducible import environment, load_kept
from grpoflow.tasks.steps import assign_advantages


def mark_cancelled(flow, flow_run, state) -> None:
    """Prefect's on_cancellation hook. It may run in the worker, after the flow's process was killed:
    the run is found by its flow run id, marked `cancelled`, and its embedded server (if that process
    left one) is stopped. `--resume RUN` continues it."""
    from grpoflow.storage.processes import stop_stale

    params = flow_run.parameters or {}
    cfg = params.get("config")
    if cfg is None and params.get("config_file"):
        cfg = load_config(params["config_file"]).model_dump()
    root = Path(((cfg or {}).get("storage") or {}).get("root") or "runs")
    store = RolloutStore(root)
    for run_id in store.runs():
        meta = store.read_run_meta(run_id) or {}
        if str(flow_run.id) in meta.get("flow_runs", []) and meta.get("status") == "running":
            store.write_run_meta(run_id, {**meta, "status": "cancelled", "error": f"cancelled: {state.name}"})
            inference = InferenceConfig.model_validate(((cfg or {}).get("inference")) or {})
            for name in replica_names(f"vllm-{run_id}", inference):
                stop_stale(root, name)


@flow(name="grpo-train", log_prints=True, on_cancellation=[mark_cancelled])
def grpo_train(
    config: GRPOConfig | None = None, resume: str | None = None, config_file: str | None = None
) -> dict[str, Any]:
    """Train a policy with async GRPO; `resume` continues a run from its latest checkpoint.

    `config` is the whole config tree (the Prefect UI renders it as a form); `config_file` (a shipped
    YAML, e.g. configs/tiny-letters.yaml) is used when `config` is not given.
    """
    cfg = config or (load_config(config_file) if config_file else GRPOConfig())
    rows = preflight(cfg, resume)  # bad input fails here, before any model is loaded or file written
    base = prepare_model(cfg)
    run = open_run(cfg, resume, base)
    flow_run = FlowRunContext.get()
    write_meta(
        cfg,
        run,
        "running",
        flow_run_id=str(flow_run.flow_run.id) if flow_run else None,
        owner=identity(),  # host + pid + start time: `grpoflow runs` tells a dead owner from a live one
        # what a rerun must match to give the same bits (benchmarks/reproducibility.py compares them)
        reproducibility=environment(
            cfg.run.seed, None if cfg.inference.external() else vllm_python(), cfg.learner.torch_threads
        ),
    )
    try:
        with ray_cluster(
            cfg.scale, cfg.config_dir, Path(cfg.storage.root) / "logs" / f"ray-{run.run_id}.log"
        ):
            summary = _train(cfg, run, rows)  # Ray only with scale.ray_address (else not imported)
    except BaseException as e:
        write_meta(cfg, run, "failed" if isinstance(e, Exception) else "cancelled", error=repr(e)[:500])
        raise
    write_meta(cfg, run, "completed", last_step=cfg.run.steps - 1)
    return summary


def served_lora(cfg: GRPOConfig) -> LoraConfig | None:
    """The adapters the run's embedded servers must load as adapters: `learner.lora` with sync.backend
    'lora'; none with 'lora_merged', whose servers merge the adapter into their weights (vLLM's LoRA
    path left off, and with it the per-request adapter matmuls)."""
    return cfg.learner.lora if cfg.sync.backend == "lora" else None


def _train(cfg: GRPOConfig, run: RunState, rows: list[dict]) -> dict[str, Any]:
    """The loop of docs/architecture.md, section 2."""
    root, steps, run_id = cfg.storage.root, cfg.run.steps, run.run_id
    store, reporter = RolloutStore(Path(root)), StepReporter(cfg, run)
    compactor = BackgroundCompactor(root, run_id, cfg.storage.compact_every, log=get_run_logger())
    pusher = weight_push(root, run_id, cfg.sync, cfg.inference)  # sync.backend
    watch = RewardWatch(cfg, run_id)
    flow_run = FlowRunContext.get()
    trackers = tracking(cfg, run_id, flow_run_id=str(flow_run.flow_run.id) if flow_run else None,
                        logger=get_run_logger())  # fmt: skip  # run.report_to; None without
    with (
        contextlib.closing(compactor),  # exits last: the flow returns after its compactions are done
        _finished(trackers),  # a failed run's trackers get what closed before it, then are closed
        inference_servers(
            cfg.inference, run.model_path, root, f"vllm-{run_id}", lora=served_lora(cfg)
        ) as started,
        contextlib.closing(replica_set(started, run, pusher)) as servers,
        contextlib.closing(build_learner(cfg, run)) as learner,
        contextlib.closing(StepRunner(cfg.run.step_task_runs)) as runner,
        contextlib.closing(StepUnits(runner, learner, pusher, servers, root=root, run_id=run_id)) as units,
    ):
        # The servers must serve exactly the learner's weights; a LoRA run's first adapter is loaded before
        # the first step too (which also finds a server that cannot load adapters before anything trains).
        if run.resumed or cfg.inference.external() or cfg.learner.lora is not None:
            units.first_push(run.policy_version)
        job = rollout_job(cfg, servers, run.base_model, rows)
        kept = load_kept(run.checkpoint) if cfg.run.reproducible else []  # generated before a resume
        pipeline = RolloutPipeline(cfg, rows, servers, job, run.start_step, runner, kept)
        evals = TrainingEval(cfg, job)  # run.eval_every
        units.recover = pipeline.recover
        if run.checkpoint is not None:  # steps closed before a kill, and a killed compaction's leftovers
            compactor.submit(run.start_step - 1, final=run.start_step >= steps)
            if trackers is not None:  # and what the trackers missed of them
                trackers.closed(run.start_step - 1)
        for step in range(run.start_step, steps):
            rec = runner.begin(step)
            batch = pipeline.next_batch(step)  # generate -> score, submitted up to max_staleness ahead
            rec.rollout = batch.metrics
            rec.advantages = assign_advantages(batch.groups, step=step, algorithm=cfg.algorithm,
                                               sync_every=cfg.sync.sync_every)  # fmt: skip
            with runner.recorded(rec):  # the step's `train-step` task run: update, persist, push
                written = units.persist(step, batch.groups)  # on a thread, beside the update
                rec.train = units.update(batch.groups)
                if _due(step, cfg.sync.sync_every, steps):
                    rec.times.settle = pipeline.before_push()  # run.reproducible: the batches ahead finish
                    rec.push = units.push(step + 1)
                rec.times.write = written()
            rec.policy_version, rec.server_restarts = servers.version, pipeline.restarts
            if evals.due(step):  # between steps, on the weights just pushed; its time is not the step's
                t0 = time.perf_counter()
                rec.eval = eval_metrics(units.evaluate(step, evals.rows, evals.job, batch.groups))
                rec.times.eval = time.perf_counter() - t0
            # The steps row lands before the checkpoint: a kill in between resumes from the previous
            # checkpoint, which deletes this step's rows and redoes it, so no table ever lacks a row.
            store.write_step(run_id, step, runner.end(rec))
            # After its rows (the failed cells are in the tables) and before its checkpoint (a resume
            # redoes the step), a reward broken for too long stops the run, once its line is shown.
            stop = watch.step(step, batch.broken)
            if stop is None and _due(step, cfg.run.checkpoint_every, steps):
                state = checkpoint_state(cfg, run_id, step, step + 1)
                kept = (
                    pipeline.to_keep()
                )  # run.reproducible: a resume trains on the batches ahead as they are
                rec.times.checkpoint = units.checkpoint(step, state, cfg.run.keep_checkpoints, kept)
                store.write_step(run_id, step, runner.end(rec))  # the same row, with the checkpoint
                compactor.submit(step, final=step == steps - 1)  # now closed; a background thread
                if trackers is not None:  # closed steps only: a resume never redoes what they show
                    trackers.closed(step)
            reporter.step(rec)
            if stop is not None:
                reporter.flush()
                raise stop
        if trackers is not None:
            trackers.finish(_report(root, run_id))  # the report's plots go to the trackers too
        reporter.finish(trackers.links() if trackers is not None else None)
    return reporter.summary()


def _report(root: str, run_id: str) -> Path | None:
    """`grpoflow report`'s files of the run (<root>/reports/<run>), for the trackers; a report that
    cannot be drawn costs the trackers their plots, never the run."""
    try:
        return write_report(root, run_id)
    except Exception as e:
        get_run_logger().warning("report not written for the trackers: %r", e)
        return None


@contextlib.contextmanager
def _finished(trackers: Tracking | None):
    """Trackers of a run that fails still get the steps that closed before, and are closed (at most
    tracking.finish_timeout_s: a dead tracking server never holds the run)."""
    try:
        yield
    except BaseException:
        if trackers is not None:
            trackers.finish(None)
        raise


class RewardWatch:
    """Counts, per required reward, the consecutive steps it failed on every completion (each one was
    logged as its batch was scored), and stops the run at `run.max_failed_reward_steps`."""

    def __init__(self, cfg: GRPOConfig, run_id: str):
        self.cfg, self.run_id = cfg, run_id
        self.streak: dict[str, list[int]] = {}  # reward name -> the steps of its current streak

    def step(self, step: int, broken: list[BrokenReward]) -> BrokenRewardError | None:
        """Count the step's broken rewards (its batch's); the error to stop the run with, once one's
        streak is due."""
        limit = self.cfg.run.max_failed_reward_steps
        broken = [b for b in broken if b.required]
        names = {b.name for b in broken}
        self.streak = {k: v for k, v in self.streak.items() if k in names}
        for b in broken:
            steps = self.streak.setdefault(b.name, [])
            steps.append(step)
            if limit and len(steps) >= limit:
                where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
                return BrokenRewardError(
                    " ".join(
                        f"reward {b.name!r} failed on every completion of {where} "
                        f"(run.max_failed_reward_steps={limit}): {b.reason}"
                        f"{'; ' + b.hint if b.hint else ''}; nothing was trained on it. Fix it and "
                        f"continue the run with --resume {self.run_id}".split()
                    )  # one line, whatever the exception's message holds
                )
        return None


def _due(step: int, every: int, steps: int) -> bool:
    """Whether something done every `every` steps (push, checkpoint) is due after `step`; always
    after the last step."""
    return (step + 1) % every == 0 or step == steps - 1
