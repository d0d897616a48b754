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

from grpoflow.flows.config import GRPOConfig, load_config
from grpoflow.flows.lineage.evaluate import TrainingEval, eval_metrics
from grpoflow.flows.processes.cluster import ray_cluster
from grpoflow.flows.processes.serve import inference_servers, replica_names
from grpoflow.flows.processes.vllm_command import served_dtype, takes_turns, vllm_python
from grpoflow.flows.training.pipeline import RolloutPipeline, replica_set
from grpoflow.flows.training.preflight import preflight
from grpoflow.flows.training.runner import StepRunner, StepUnits
from grpoflow.flows.training.runs import (
    RunState,
    build_learner,
    open_run,
    prepare_model,
    rollout_job,
    write_meta,
)
from grpoflow.flows.training.step_close import StepClose, due, finished
from grpoflow.flows.viewing.tracking import tracking
from grpoflow.storage.compact import BackgroundCompactor
from grpoflow.storage.faults import failpoint
from grpoflow.storage.processes import identity
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.advantages import assign_advantages
from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.push.push import weight_push
from grpoflow.tasks.rollouts.reproducible import environment, load_kept


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
    failpoint("run_start")  # kill drills: a run recorded `running` that has started nothing yet
    try:
        with ray_cluster(
            cfg.scale, cfg.config_dir, Path(cfg.storage.root) / "logs" / f"ray-{run.run_id}.log"
        ):
            summary = _train(cfg, run, rows)  # Ray only with scale.ray_address (else not imported)
    except BaseException as e:
        write_meta(cfg, run, "failed" if isinstance(e, Exception) else "cancelled", error=repr(e)[:500])
        raise
    write_meta(cfg, run, "completed", last_step=cfg.run.steps - 1, transports=summary["transports"])
    return summary


def served_lora(cfg: GRPOConfig) -> LoraConfig | None:
    """The adapters the run's embedded servers must load as adapters: `learner.lora` with sync.backend
    'lora'; none with 'lora_merged', whose servers merge the adapter into their weights (vLLM's LoRA
    path left off, and with it the per-request adapter matmuls)."""
    return cfg.learner.lora if cfg.sync.backend == "lora" else None


def _train(cfg: GRPOConfig, run: RunState, rows: list[dict]) -> dict[str, Any]:
    """The loop of docs/architecture.md, section 2: a step's units in order, then its close."""
    root, run_id = cfg.storage.root, run.run_id
    compactor = BackgroundCompactor(root, run_id, cfg.storage.compact_every, log=get_run_logger())
    pusher = weight_push(root, run_id, cfg.sync, cfg.inference)  # sync.backend
    flow_run = FlowRunContext.get()
    # run.report_to; None without
    trackers = tracking(
        cfg, run_id, flow_run_id=str(flow_run.flow_run.id) if flow_run else None, logger=get_run_logger()
    )
    with (
        contextlib.closing(compactor),  # exits last: the flow returns after its compactions are done
        finished(trackers),  # a failed run's trackers get what closed before it, then are closed
        inference_servers(
            cfg.inference,
            run.model_path,
            root,
            f"vllm-{run_id}",
            served_lora(cfg),
            served_dtype(cfg),
            spin=takes_turns(cfg),
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
        close = StepClose(cfg, run, runner, units, pipeline, compactor, trackers)
        for step in range(run.start_step, cfg.run.steps):
            rec = runner.begin(step)
            batch = pipeline.next_batch(step)  # generate -> score, submitted up to max_staleness ahead
            rec.rollout = batch.metrics
            rec.advantages = assign_advantages(
                batch.groups, step=step, algorithm=cfg.algorithm, sync_every=cfg.sync.sync_every
            )
            with runner.recorded(rec):  # the step's `train-step` task run: update, persist, push
                written = units.persist(step, batch.groups)  # on a thread, beside the update
                rec.train = units.update(batch.groups)
                if due(step, cfg.sync.sync_every, cfg.run.steps):
                    rec.times.settle = pipeline.before_push()  # run.reproducible: the batches ahead finish
                    rec.push = units.push(step + 1)
                rec.times.write = written()
            rec.policy_version, rec.server_restarts = servers.version, pipeline.restarts
            if evals.due(step):  # between steps, on the weights just pushed; its time is not the step's
                t0 = time.perf_counter()
                rec.eval = eval_metrics(units.evaluate(step, evals.rows, evals.job, batch.groups))
                rec.times.eval = time.perf_counter() - t0
            close.step(step, rec, batch.broken, batch.masked)  # row, reward watch, checkpoint, trackers
        # server URL -> how its versions travelled ('path' or 'network'), for the run's record
        return {**close.finish(), "transports": pusher.transport.chosen()}
