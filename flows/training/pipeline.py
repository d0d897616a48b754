"""Generation + scoring ahead of training: the run's servers as a ReplicaSet, and the rollout pipeline."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Future

from prefect import get_run_logger

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.processes.launch import is_healthy
from grpoflow.flows.processes.serve import Server
from grpoflow.flows.training.data import rows_for_step
from grpoflow.flows.training.runner import StepRunner
from grpoflow.flows.training.runs import RunState
from grpoflow.tasks.push.push import WeightPush, load_version
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.replicas import MAX_RESTARTS, Replica, ReplicaSet
from grpoflow.tasks.steps import RolloutBatch, RolloutJob, handed_over, rollout_batch


def replica_set(servers: list[Server], run: RunState, pusher: WeightPush) -> ReplicaSet:
    """The run's servers as a ReplicaSet: embedded ones restart through their handles; a revived
    server loads the weights the others serve through the run's weight push, and requests name the
    model the push serves each version as."""
    reps = [Replica(i, s.url) for i, s in enumerate(servers)]
    for rep, s in zip(reps, servers, strict=True):
        if s.handle is not None:
            rep.restart, rep.alive = s.handle.restart, (lambda h=s.handle: h.alive() and h.healthy())
    out = ReplicaSet(reps, version=run.policy_version)
    out.is_healthy = is_healthy
    out.load = lambda rep, path, version: load_version(pusher, rep.url, path, version, rep.versions.set)
    out.model_name = pusher.model_name  # requests name the version they run under (lora: its adapter)
    return out


class RolloutPipeline:
    """Generation + scoring of future steps, submitted up to `max_staleness` ahead of training.

    A server that fails leaves the rotation and its groups are generated on the others, while its
    reviver restarts it (embedded) or waits for it (external) and loads the current weights
    (tasks/rollouts/replicas.py). When no server is left the step's batch fails with InferenceUnavailableError:
    the pipeline waits for an embedded server to come back and generates the lost batches again; with
    external servers only, the run stops, resumable.
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        rows,
        servers: ReplicaSet,
        job: RolloutJob,
        first_step: int,
        runner: StepRunner,
        kept: list[RolloutBatch] = (),
    ):
        self.cfg, self.rows, self.servers, self.job, self.runner = cfg, rows, servers, job, runner
        self.ahead: deque[tuple[object, Future, int]] = deque()
        self.next_step = first_step
        self.kept = {b.step: b for b in kept}  # batches a checkpoint kept (run.reproducible), by step

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.servers.replicas)

    def _submit(self, step: int) -> tuple[object, Future, int]:
        kept = self.kept.pop(step, None)
        if kept is not None:  # generated before the resume under the weights of its time: used as it is
            done: Future = Future()
            done.set_result(kept)
            return done, done, step
        d = self.cfg.data
        batch_rows, cursor = rows_for_step(
            self.rows, step, d.prompts_per_step, seed=self.cfg.run.seed, shuffle=d.shuffle
        )
        handoff: Future = Future()  # the batch, the moment the task's body has it
        return self.runner.submit(rollout_batch, step, batch_rows, cursor, self.job, handoff), handoff, step

    def next_batch(self, step: int) -> RolloutBatch:
        """Step `step`'s batch (generated -> scored), once the steps up to `max_staleness` ahead of it
        are submitted; the learner's wait goes to the runner; recovers from dead embedded servers."""
        while (
            self.next_step < self.cfg.run.steps and self.next_step <= step + self.cfg.algorithm.max_staleness
        ):
            self.ahead.append(self._submit(self.next_step))
            self.next_step += 1
        t_wait = time.perf_counter()
        while True:
            future, handoff, _ = self.ahead[0]
            try:
                batch = handed_over(future, handoff)
            except InferenceUnavailableError as e:
                self.recover(e)
                continue
            self.ahead.popleft()
            self.runner.waited(batch, t_wait)
            return batch

    def before_push(self) -> float | None:
        """run.reproducible: wait until every batch submitted ahead is generated, so that the push that
        follows changes no batch's weights mid-way and each is generated wholly under the version served
        when it was submitted (its submission, in the flow's thread, decides that); the seconds waited.
        None (no wait) without it."""
        if not self.cfg.run.reproducible:
            return None
        t0 = time.perf_counter()
        self._settled()
        return time.perf_counter() - t0

    def to_keep(self) -> list[RolloutBatch]:
        """run.reproducible: the batches submitted ahead, once generated, for the checkpoint to keep (a
        resume trains on them as they are); none without it."""
        return self._settled() if self.cfg.run.reproducible else []

    def _settled(self) -> list[RolloutBatch]:
        """The batches submitted ahead, in step order, once each is generated and scored; one that failed
        is left out: next_batch recovers it."""
        out = []
        for future, handoff, _ in self.ahead:
            with contextlib.suppress(Exception):
                out.append(handed_over(future, handoff))
        return out

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
        # Every in-flight batch may have died with the servers: generate them again under new futures
        # (a batch already handed over is kept).
        self.ahead = deque(a if a[1].done() else self._submit(a[2]) for a in self.ahead)
