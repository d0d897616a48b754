"""The learner on several processes: `learner.world_size` ranks as Ray actors, one sharded model.

`DistributedLearner` is a `tasks.learner_api.PolicyLearner`, as a `Learner` is. It starts N actors on the run's Ray cluster (one GPU each on
a cluster with N GPUs, else CPU processes), joins them in one `torch.distributed` process group (NCCL
on GPU, gloo on CPU) whose every collective times out after `learner.collective_timeout_s`, and builds
a `tasks.learn.Learner` in each, which shards the model with FSDP2. Each call goes to every rank at
once: a train step sends the whole batch to all of them (each plans it whole, so the loss normalisers
are global, and runs its share of the micro-batches); the ranks' metrics are merged here.

A rank that fails or dies fails the call: the error names the rank and says what it was doing, the
other ranks are stopped (they would wait in a collective until its timeout), and this learner refuses
further calls. The run stops there and resumes from its last checkpoint, whose optimizer state loads at
any world size. Checkpoint and weight directories must be on a filesystem every rank can write (one
machine, or a shared mount on a cluster).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpoflow.storage.faults import ENV as FAULTS_ENV
from grpoflow.storage.faults import failpoint
from grpoflow.tasks.learner.learn import Learner
from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.step_metrics import StepRun, empty_step_metrics, merge_ranks, step_metrics
from grpoflow.tasks.remote import node_address

if TYPE_CHECKING:
    from grpoflow.tasks.config.algorithm import AlgorithmConfig
    from grpoflow.tasks.config.learner import LearnerConfig
    from grpoflow.tasks.config.model import ModelConfig
    from grpoflow.tasks.config.rollouts import GenerationConfig
    from grpoflow.tasks.learner.learner_api import LearnerRun

log = logging.getLogger(__name__)

# What the ranks are doing in each call `DistributedLearner` makes on them, for the error naming a
# failed rank. Keyed by the Learner's methods themselves, so renaming one cannot leave a stale name.
_DOING: dict[Callable[..., Any], str] = {
    Learner.run_updates: "running a train step",
    Learner.advance_schedule: "moving the learning-rate schedule past an empty step",
    Learner.write_weights: "writing the weights for the servers",
    Learner.save: "writing a checkpoint",
    Learner.load_trainer_state: "loading a checkpoint",
}


class LearnerRankError(RuntimeError):
    """A rank of a sharded learner failed; the learner's ranks are stopped and the run must resume."""


class LearnerRank:
    """One rank: a process in the learner's process group holding a `Learner` (a Ray actor)."""

    def __init__(self) -> None:
        self.learner: Learner | None = None
        self.rank = 0
        self.store = None  # rank 0's rendezvous store (`address`)

    def address(self, timeout_s: float) -> tuple[str, int]:
        """Where rank 0 listens for the others: this node's address and the port of the rendezvous store
        it opens here (port 0: the system picks one as the store binds it, so no other process can take
        it between the choice and the bind)."""
        import torch.distributed as dist

        host = node_address()
        self.store = dist.TCPStore(
            host, 0, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return host, self.store.port

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The address of the Ray node this rank runs on (its host)."""
        return node_address()

    def start(
        self,
        rank: int,
        world_size: int,
        address: tuple[str, int],
        timeout_s: float,
        device: str,
        build: Callable[[], Learner],
    ) -> None:
        """Join the process group, then `build()` this rank's Learner inside it (it shards itself)."""
        import torch
        import torch.distributed as dist

        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)  # Ray shows each rank only its own GPU
        host, port = address
        timeout = timedelta(seconds=timeout_s)
        # Gloo and NCCL find their own address by this host's name, which on many machines resolves to
        # a loopback address that other hosts cannot reach: the ranks talk on the Ray node's interface.
        interface = _interface_of(self.node())
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        store = self.store if rank == 0 else dist.TCPStore(host, port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        self.rank = rank
        self.learner = build()

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        """`method(learner, *args)`: `method` is one of `Learner`'s own (unbound), not its name."""
        if method is Learner.run_updates and self.rank == self.learner.world_size - 1:
            failpoint("learner_rank")
        return method(self.learner, *args)

    def peak_memory_mib(self) -> float:
        """This rank's peak memory: CUDA bytes allocated on a GPU, else the process's peak RSS."""
        import resource

        import torch

        if self.learner is not None and self.learner.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.learner.device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_device(learner: LearnerConfig) -> str:
    """Where the ranks run: cuda when `learner.device` asks for it (the Ray cluster must then have a
    GPU per rank) or, on auto, when it has them; else cpu."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if learner.device == "cuda" and gpus < learner.world_size:
        raise ValueError(
            f"learner.world_size {learner.world_size} on cuda needs {learner.world_size} GPUs; the Ray "
            f"cluster has {gpus:g}"
        )
    cuda = learner.device == "cuda" or (learner.device == "auto" and gpus >= learner.world_size)
    return "cuda" if cuda else "cpu"


class DistributedLearner:
    """`learner.world_size` ranks of one sharded learner, used like a `Learner` (module doc).

    Needs a connected Ray (the flow's `scale.ray_address`). Takes what a `Learner` takes."""

    def __init__(
        self,
        model_path: str | Path,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        run: LearnerRun,
        generation: GenerationConfig | None = None,
        model: ModelConfig | None = None,
        *,
        skip_zero_advantage: bool = True,
    ):
        import ray

        self.config, self.algorithm = learner, algorithm
        self.world_size = learner.world_size
        self.model_path = str(model_path)
        self.tokenizer_path = str(run.tokenizer_path or model_path)
        self.failed: str | None = None
        self.device = _rank_device(learner)
        cuda = self.device == "cuda"
        # Failpoints set for this run reach its ranks too (crash drills kill a rank mid-step).
        faults = {FAULTS_ENV: os.environ[FAULTS_ENV]} if os.environ.get(FAULTS_ENV) else None
        actor = ray.remote(LearnerRank).options(
            num_cpus=learner.torch_threads or 1,
            num_gpus=1 if cuda else 0,
            max_restarts=0,
            scheduling_strategy="SPREAD",  # a rank per node while there are nodes with room
            runtime_env={"env_vars": faults} if faults else None,
        )
        self.ranks = [actor.remote() for _ in range(self.world_size)]
        self.nodes: list[str] = []  # each rank's node, once they run (errors name it)
        config = learner.model_copy(update={"device": self.device})
        build = functools.partial(
            Learner,
            self.model_path,
            config,
            algorithm,
            run,
            generation,
            model,
            skip_zero_advantage=skip_zero_advantage,
        )
        timeout = learner.collective_timeout_s
        try:
            self.nodes = self._wait([r.node.remote() for r in self.ranks], "starting")
            log.info("learner ranks on nodes %s", ", ".join(f"{i}: {n}" for i, n in enumerate(self.nodes)))
            address = self._wait([self.ranks[0].address.remote(timeout)], "opening rank 0's store")[0]
            self._wait(
                [
                    r.start.remote(i, self.world_size, address, timeout, self.device, build)
                    for i, r in enumerate(self.ranks)
                ],
                "starting",
            )
        except BaseException:
            self.close()
            raise

    # -- PolicyLearner ----------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One step on all ranks (tasks.learn.Learner.train_step); the ranks' metrics merged."""
        import ray

        t0 = time.perf_counter()
        if not samples:
            self._all(Learner.advance_schedule, 0)
            return empty_step_metrics(time.perf_counter() - t0)
        batch = ray.put(samples)
        runs: list[StepRun] = self._all(Learner.run_updates, batch)
        run = merge_ranks(runs)
        return step_metrics(run, len(samples), self.algorithm.num_iterations, time.perf_counter() - t0)

    def write_weights(self, directory: Path) -> None:
        self._all(Learner.write_weights, Path(directory))

    def save(self, directory: Path) -> None:
        self._all(Learner.save, Path(directory))

    def load_trainer_state(self, directory: Path) -> None:
        self._all(Learner.load_trainer_state, Path(directory))

    def close(self) -> None:
        """Stop the ranks (their process group goes with them)."""
        import ray

        for r in self.ranks:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(r, no_restart=True)
        self.ranks = []

    # -- calls on every rank ----------------------------------------------------------------------

    def _all(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """`method` (one of `Learner`'s, unbound) with `args` on every rank's learner at once."""
        if self.failed is not None:
            raise LearnerRankError(f"the learner's ranks were stopped after {self.failed}; resume the run")
        return self._wait([r.call.remote(method, *args) for r in self.ranks], _DOING[method])

    def _wait(self, refs: list, doing: str) -> list[Any]:
        """The ranks' results; the first failure stops them all and raises (module doc)."""
        import ray
        from ray.exceptions import RayActorError

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except BaseException as first:
                # The others fail soon after (a peer is gone); a dead rank is the cause, if one died.
                late, _ = ray.wait(pending, num_returns=len(pending), timeout=2.0) if pending else ([], [])
                errors = [(refs.index(done[0]), first)] + [(refs.index(r), _error(r)) for r in late]
                errors = [(i, e) for i, e in errors if e is not None]
                rank, cause = next(((i, e) for i, e in errors if isinstance(e, RayActorError)), errors[0])
                on = f" (on {self.nodes[rank]})" if rank < len(self.nodes) else ""
                self.failed = f"rank {rank}{on} failed while {doing}"
                self.close()
                raise LearnerRankError(f"learner {self.failed}: {_short(cause)}") from cause
        return ray.get(refs)


def _interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 `address`, None if none does."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def _error(ref) -> BaseException | None:
    import ray

    try:
        ray.get(ref)
    except BaseException as e:
        return e
    return None


def _short(e: BaseException) -> str:
    """The last line of a rank's error (Ray's carries the remote traceback before it), without the
    C++ source location gloo and NCCL put first."""
    text = str(e).strip().splitlines()
    return re.sub(r"^((?:\w+Error: )?)\[[^\]]*\]\s*", r"\1", text[-1]) if text else type(e).__name__
