"""grpo-train: the pipelined async GRPO loop (docs/architecture.md, section 2).

Generation + scoring of step s+k runs while step s trains (k = max_staleness); weights are pushed
into the running vLLM server every `sync_every` steps; rollouts, rewards and a steps row land in
Parquet every step; checkpoints make the run resumable.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import Task, flow, get_run_logger
from prefect.context import FlowRunContext
from prefect.utilities.annotations import quote

from flows.cluster import ray_cluster
from flows.config import GRPOConfig, load_config
from flows.progress import StepReporter
from flows.runs import (
    RunState,
    build_learner,
    checkpoint_state,
    open_run,
    preflight,
    prepare_model,
    rollout_job,
    rows_for_step,
    write_meta,
)
from flows.serve import Server, inference_servers, replica_names
from storage.compact import BackgroundCompactor
from storage.processes import identity
from storage.rollouts import RolloutStore
from tasks.config import InferenceConfig
from tasks.learner_api import PolicyLearner
from tasks.replicas import MAX_RESTARTS, Replica, ReplicaSet
from tasks.steps import (
    PushJob,
    RolloutBatch,
    RolloutJob,
    StepOutcome,
    assign_advantages,
    handed_over,
    persist_step,
    push_weights,
    rollout_batch,
    save_checkpoint,
    train_step,
    train_step_run,
)


class StepTimer:
    """Where one step's wall time goes: the learner idling for generation, and what Prefect's task runs
    add to the step's critical path: a task called in the loop costs its call's time minus the time its
    body reports; a submitted one its submit call; a rollout batch the part of the learner's wait its
    body did not run in (a dispatch while the learner trains is hidden)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.end = self.start  # when metrics() last read the wall time: where the next step starts
        self.wait = 0.0  # the learner idling for generation
        self.prefect = 0.0

    def submitted(self, seconds: float) -> None:
        self.prefect += seconds

    def waited(self, batch: RolloutBatch, t_wait: float) -> None:
        """The oldest batch arrived now, after the learner waited since `t_wait`: count the idle time,
        and as Prefect's the part of it the task's body (its start and end are in the batch) did not
        run in: its dispatch, when it ran late, and its result's hand-off."""
        now = time.perf_counter()
        self.wait = now - t_wait
        body = max(0.0, min(batch.body_end, now) - max(batch.body_start, t_wait))
        self.prefect += max(0.0, self.wait - body)

    def call(self, task: Callable[..., Any], *args: Any, body: Callable[[Any], float], **kwargs: Any) -> Any:
        """Run a task; `body(result)` is the seconds its body reports, and the rest of the call counts
        as Prefect's."""
        t0 = time.perf_counter()
        out = task(*args, **kwargs)
        self.prefect += max(0.0, time.perf_counter() - t0 - body(out))
        return out

    def recorded(
        self, record: Task, work: Callable[..., StepOutcome], *args: Any, **kwargs: Any
    ) -> StepOutcome:
        """`work(*args, **kwargs)` run here, with `record` (a task whose body waits for the work's
        outcome: tasks.steps.train_step_run) submitted as its task run: Prefect's part of the step is
        the submit call; the run's own bookkeeping is on the task runner's thread, off the critical
        path. The task run fails with the work's error."""
        t0 = time.perf_counter()
        outcome: Future = Future()
        record.submit(quote(outcome))
        self.prefect += time.perf_counter() - t0
        try:
            done = work(*args, **kwargs)
        except BaseException as e:  # an interrupt ends the task run as a failure, not in its thread
            outcome.set_exception(e if isinstance(e, Exception) else RuntimeError(f"interrupted: {e!r}"))
            raise
        outcome.set_result(done)
        return done

    def metrics(self) -> dict[str, float]:
        self.end = time.perf_counter()
        wall = self.end - self.start
        return {
            "wall_seconds": wall,
            "wait_seconds": self.wait,
            "prefect_overhead_seconds": self.prefect,
            "prefect_overhead_frac": self.prefect / wall if wall > 0 else 0.0,
        }


class PolicySync:
    """The learner's weights and their way into the servers: `trained` is the version the learner
    holds (training steps so far), `push(version)` makes the servers serve it."""

    def __init__(self, learner: PolicyLearner, job: PushJob, trained: int):
        self.learner, self.job, self.trained = learner, job, trained
        self.recover: Callable[[Exception], None] | None = None  # brings dead servers back

    def push(self, version: int) -> dict:
        """The push as its own task (`push-weights`): a run's first, and a step's whose push inside
        train-step failed."""
        from tasks.inference import InferenceUnavailableError

        try:
            return push_weights(quote(self.learner), version, quote(self.job))
        except InferenceUnavailableError as e:  # no server took it: bring them back, then push again
            if self.recover is None:
                raise
            self.recover(e)
            return push_weights(quote(self.learner), version, quote(self.job))


class RolloutPipeline:
    """Generation + scoring of future steps, submitted up to `max_staleness` ahead of training.

    A server that fails leaves the rotation and its groups are generated on the others, while its
    reviver restarts it (embedded) or waits for it (external) and loads the current weights
    (tasks/replicas.py). When no server is left the step's batch fails with InferenceUnavailableError:
    the pipeline waits for an embedded server to come back and generates the lost batches again; with
    external servers only, the run stops, resumable.
    """

    def __init__(self, cfg: GRPOConfig, rows, servers: ReplicaSet, job: RolloutJob, first_step: int):
        self.cfg, self.rows, self.servers, self.job = cfg, rows, servers, job
        self.ahead: deque = deque()
        self.next_step = first_step
        # run.step_task_runs off: the batches are plain calls on threads of this run's (flow run) context
        self.pool = None if cfg.run.step_task_runs else ThreadPoolExecutor(thread_name_prefix="rollout")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)  # a failed run does not wait for batches

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.servers.replicas)

    def _submit(self, step: int) -> tuple[Any, Future, int]:
        d = self.cfg.data
        batch_rows, cursor = rows_for_step(self.rows, step, d.prompts_per_step, seed=self.cfg.run.seed,
                                           shuffle=d.shuffle)  # fmt: skip
        handoff: Future = Future()
        if self.pool is not None:
            run = contextvars.copy_context().run
            return (
                self.pool.submit(run, rollout_batch.fn, step, batch_rows, cursor, self.job, handoff),
                handoff,
                step,
            )
        return rollout_batch.submit(step, batch_rows, cursor, quote(self.job), quote(handoff)), handoff, step

    def fill(self, step: int, timer: StepTimer) -> None:
        while (
            self.next_step < self.cfg.run.steps and self.next_step <= step + self.cfg.algorithm.max_staleness
        ):
            t0 = time.perf_counter()
            self.ahead.append(self._submit(self.next_step))
            timer.submitted(time.perf_counter() - t0)
            self.next_step += 1

    def next_batch(self, timer: StepTimer) -> RolloutBatch:
        """The oldest step's batch (the wait goes to `timer`); recovers from dead embedded servers."""
        from tasks.inference import InferenceUnavailableError

        t_wait = time.perf_counter()
        while True:
            future, handoff, _ = self.ahead[0]
            try:
                batch = handed_over(future, handoff)
            except InferenceUnavailableError as e:
                self.recover(e)
                continue
            self.ahead.popleft()
            timer.waited(batch, t_wait)
            return batch

    def recover(self, error: Exception) -> None:
        """No server answered: wait until a restarted embedded one serves the current weights, then
        generate the in-flight batches again; raise (resumable) when that cannot happen."""
        servers = self.servers
        if all(r.restart is None for r in servers.replicas):
            kind = "external server" if len(servers) == 1 else f"all {len(servers)} external servers"
            raise RuntimeError(f"vLLM server unavailable ({kind}); the run is resumable: {error}") from error
        for r in servers.replicas:
            if r.healthy and r.alive is not None and not r.alive():  # died without a failed request yet
                servers.down(r, error)
        if not servers.serving():  # else a transient failure: the servers answer, generate again
            get_run_logger().warning("no vLLM server answers (%s); waiting for a restart", error)
            timeout = (MAX_RESTARTS + 1) * (self.cfg.inference.startup_timeout_s + 60)
            if not servers.wait_any_up(timeout):
                raise RuntimeError(
                    f"vLLM server unavailable ({servers.all_down()}); the run is resumable: {error}"
                ) from error
        # Every in-flight batch may have died with the servers: generate them again under new futures.
        self.ahead = deque(self._submit(step) for *_, step in self.ahead)


def replica_set(cfg: GRPOConfig, servers: list[Server], run: RunState, root: str) -> ReplicaSet:
    """The run's servers as a ReplicaSet: embedded ones restart through their handles; a revived
    server loads the weights the others serve (tasks.push.load_into)."""
    from flows.serve import is_healthy
    from tasks.push import load_into

    reps = [Replica(i, s.url) for i, s in enumerate(servers)]
    for rep, s in zip(reps, servers, strict=True):
        if s.handle is not None:
            rep.restart, rep.alive = s.handle.restart, (lambda h=s.handle: h.alive() and h.healthy())
    out = ReplicaSet(reps, version=run.policy_version)
    out.is_healthy = is_healthy
    out.load = lambda rep, path, version: load_into(
        rep, path, version, root=root, run_id=run.run_id, inference=cfg.inference,
        reload_timeout_s=cfg.sync.reload_timeout_s,
    )  # fmt: skip
    return out


def mark_cancelled(flow, flow_run, state) -> None:
    """Prefect's on_cancellation hook. It may run in the worker, after the flow's process was killed:
    the run is found by its flow run id, marked `cancelled`, and its embedded server (if that process
    left one) is stopped. `--resume RUN` continues it."""
    from storage.processes import stop_stale

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
    )
    try:
        with ray_cluster(
            cfg.scale, cfg._config_dir, Path(cfg.storage.root) / "logs" / f"ray-{run.run_id}.log"
        ):
            summary = _train(cfg, run, rows)  # Ray only with scale.ray_address (else not imported)
    except BaseException as e:
        write_meta(cfg, run, "failed" if isinstance(e, Exception) else "cancelled", error=repr(e)[:500])
        raise
    write_meta(cfg, run, "completed", last_step=cfg.run.steps - 1)
    return summary


def _train(cfg: GRPOConfig, run: RunState, rows: list[dict]) -> dict[str, Any]:
    """The loop of docs/architecture.md, section 2."""
    root, steps, run_id = cfg.storage.root, cfg.run.steps, run.run_id
    store, reporter = RolloutStore(Path(root)), StepReporter(cfg, run)
    compactor = BackgroundCompactor(root, run_id, cfg.storage.compact_every, log=get_run_logger())
    with (
        contextlib.closing(compactor),  # exits last: the flow returns after its compactions are done
        inference_servers(cfg.inference, run.model_path, root, f"vllm-{run_id}") as started,
        contextlib.closing(replica_set(cfg, started, run, root)) as servers,
        contextlib.ExitStack() as stack,
    ):
        learner = build_learner(cfg, run)
        stack.callback(learner.close)
        push_job = PushJob(root, run_id, cfg.sync, cfg.inference, servers)
        weights = PolicySync(learner, push_job, trained=run.policy_version)
        if run.resumed or cfg.inference.external():  # the servers must serve exactly the learner's weights
            weights.push(run.policy_version)
        job = rollout_job(cfg, servers, run.base_model)
        pipeline = stack.enter_context(
            contextlib.closing(RolloutPipeline(cfg, rows, servers, job, run.start_step))
        )
        weights.recover = pipeline.recover
        if run.checkpoint is not None:  # steps closed before a kill, and a killed compaction's leftovers
            compactor.submit(run.start_step - 1, final=run.start_step >= steps)
        timer = None
        for step in range(run.start_step, steps):
            # A step's wall time runs from the previous step's (whose row write and report it includes).
            timer = StepTimer(timer.end if timer else None)
            pipeline.fill(step, timer)  # generate -> score up to max_staleness steps ahead
            batch = pipeline.next_batch(timer)
            m = batch.metrics | assign_advantages(
                batch.groups, step=step, algorithm=cfg.algorithm, sync_every=cfg.sync.sync_every
            )
            version = step + 1 if _due(step, cfg.sync.sync_every, steps) else None
            # The step's rows written beside the update, the update, the push when due: one task run.
            work = dict(
                step=step, root=root, run_id=run_id, push=push_job if version else None, version=version
            )
            if cfg.run.step_task_runs:
                done = timer.recorded(train_step_run, train_step, learner, batch.groups, **work)
            else:
                done = train_step(learner, batch.groups, **work)
            weights.trained = step + 1
            m |= done.metrics
            if done.persist_error is not None:  # the update is applied: write its rows again, own task
                get_run_logger().warning(
                    "step %d: writing rollouts failed (%r); retrying", step, done.persist_error
                )
                m["write_seconds"] = persist_step(root, run_id, step, quote(batch.groups))
            m["sync_seconds"] = 0.0
            if version is not None:
                if done.push_error is not None:  # again as push-weights: its retries, dead servers revived
                    get_run_logger().warning(
                        "step %d: weight push failed (%r); retrying", step, done.push_error
                    )
                    m |= weights.push(version)  # not timed: a server's recovery is not Prefect's time
                m["sync_seconds"] = m["sync/total_seconds"]
            m |= {"policy_version": servers.version, "server_restarts": pipeline.restarts} | timer.metrics()
            # The steps row lands before the checkpoint: a kill in between resumes from the previous
            # checkpoint, which deletes this step's rows and redoes it, so no table ever lacks a row.
            store.write_step(run_id, step, m)
            if _due(step, cfg.run.checkpoint_every, steps):
                state = checkpoint_state(cfg, run_id, step, weights.trained)
                m["checkpoint_seconds"] = timer.call(save_checkpoint, quote(learner), root=root, run_id=run_id,
                                                     step=step, state=state, keep=cfg.run.keep_checkpoints,
                                                     body=lambda seconds: seconds)  # fmt: skip
                store.write_step(run_id, step, m | timer.metrics())  # the same row, with the checkpoint
                compactor.submit(step, final=step == steps - 1)  # now closed; a background thread
            reporter.step(step, m)
        reporter.finish()
    return reporter.summary()


def _due(step: int, every: int, steps: int) -> bool:
    """Whether something done every `every` steps (push, checkpoint) is due after `step`; always
    after the last step."""
    return (step + 1) % every == 0 or step == steps - 1
