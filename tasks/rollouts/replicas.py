"""Several generation servers: routing, health, and the weights each one serves.

A run generates on one or more vLLM servers (`inference.urls`, or `inference.replicas` embedded ones).
`ReplicaSet.pick` gives each group the healthy server with the fewest groups in flight (ties: the one
that has served the fewest). A server whose requests fail for good, or whose weight push fails, is
marked down and leaves the rotation; the group is generated again on another server. A reviver thread
brings it back: an embedded server is restarted (bounded), an external one is polled until it answers;
either way it loads the weights the others serve before it rejoins. Every server has its own
`VersionBox`, so a completion records the version of the server that generated it.

Pure bookkeeping plus threads: the flow supplies how a server is restarted and how weights are loaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError


class VersionBox:
    """The policy version a server serves, shared between the pusher and the generators."""

    def __init__(self, version: int = 0):
        self._v = version
        self._lock = threading.Lock()

    def get(self) -> int:
        with self._lock:
            return self._v

    def set(self, v: int) -> None:
        with self._lock:
            self._v = v


@dataclass
class Replica:
    """One generation server. `restart` and `alive` (embedded servers only): replace its process,
    returning once it is healthy; whether it runs. External servers have neither."""

    index: int
    url: str
    versions: VersionBox = field(default_factory=VersionBox)
    restart: Callable[[], None] | None = None
    alive: Callable[[], bool] | None = None  # embedded: the process runs and answers /health
    healthy: bool = True
    in_flight: int = 0
    served: int = 0  # groups generated here, this run
    failures: int = 0
    restarts: int = 0
    down_reason: str | None = None
    gave_up: bool = False  # its restarts ran out: out of the rotation for the rest of the run


# Restarts of one embedded server before it is given up on (a crash loop is not a transient fault).
MAX_RESTARTS = 3


class ReplicaSet:
    """The run's generation servers. Thread-safe: rollout tasks, pushes and revivers share it."""

    def __init__(self, replicas: list[Replica], version: int = 0, weights_path: str | None = None):
        if not replicas:
            raise ValueError("a run needs at least one generation server")
        self.replicas = replicas
        self._lock = threading.Condition()
        # What the serving replicas hold: a revived replica loads it before it rejoins.
        self.version, self.weights_path = version, weights_path
        for r in replicas:
            r.versions.set(version)
        self._pushing = False
        # The flow's: load weights (path, version) into a replica, and ask whether a server answers.
        self.load: Callable[[Replica, str, int], None] | None = None
        self.is_healthy: Callable[[str], bool] = lambda url: False
        # The model a request under a version names (the weight push's `model_name`): None for the
        # server's own model (a checkpoint push replaces its weights), else a LoRA adapter's name.
        self.model_name: Callable[[int], str | None] = lambda version: None
        self.poll_s = 2.0
        self._stop = threading.Event()
        # Replicas a reviver is bringing back; under the lock, and cleared in the same critical section
        # that ends the revival, so a replica that fails again right after rejoining gets a new one.
        self._reviving: set[int] = set()

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    # -- routing ------------------------------------------------------------------------------------

    def pick(self) -> Replica:
        """The healthy server with the fewest groups in flight; raises InferenceUnavailableError when
        none is up (the run stops resumably, or the pipeline waits for a restart)."""
        with self._lock:
            up = [r for r in self.replicas if r.healthy]
            if not up:
                raise InferenceUnavailableError(self.all_down())
            rep = min(up, key=lambda r: (r.in_flight, r.served, r.index))
            rep.in_flight += 1
            return rep

    def done(self, rep: Replica, ok: bool) -> None:
        with self._lock:
            rep.in_flight -= 1
            rep.served += ok

    def all_down(self) -> str:
        why = "; ".join(f"{r.url}: {r.down_reason or 'down'}" for r in self.replicas)
        return f"all {len(self.replicas)} vLLM servers are down ({why})"

    # -- health -------------------------------------------------------------------------------------

    def down(self, rep: Replica, error: BaseException) -> None:
        """Take `rep` out of the rotation and start bringing it back."""
        with self._lock:
            if not rep.healthy:
                return
            rep.healthy, rep.failures, rep.down_reason = False, rep.failures + 1, str(error)[:300]
            self._lock.notify_all()
            revive = not self._stop.is_set() and self.load is not None and rep.index not in self._reviving
            if revive:
                self._reviving.add(rep.index)
        if revive:
            name = f"grpoflow-revive-{rep.index}"
            threading.Thread(target=self._reviver, args=(rep,), name=name, daemon=True).start()

    def serving(self) -> list[Replica]:
        with self._lock:
            return [r for r in self.replicas if r.healthy]

    def wait_any_up(self, timeout_s: float) -> bool:
        """Block until a server serves (True) or every reviver has given up / `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not any(r.healthy for r in self.replicas):
                if all(r.gave_up or (r.restart is None and self._stop.is_set()) for r in self.replicas):
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 1.0))
            return True

    def _reviver(self, rep: Replica) -> None:
        """Bring `rep` back: restart it (embedded) or wait until it answers (external), then load the
        weights the others serve; it rejoins only at the current version, with no push under way."""
        while not self._stop.is_set():
            try:
                if rep.restart is not None:
                    if rep.restarts >= MAX_RESTARTS:
                        with self._lock:
                            rep.gave_up = True
                            rep.down_reason = f"{rep.down_reason}; gave up after {rep.restarts} restarts"
                            self._reviving.discard(rep.index)
                            self._lock.notify_all()
                        return
                    rep.restarts += 1
                    rep.restart()
                elif not self.is_healthy(rep.url):
                    self._stop.wait(self.poll_s)
                    continue
                if self._rejoin(rep):
                    return
            except Exception as e:  # a failed restart or load: try again (restarts are bounded)
                rep.down_reason = f"{type(e).__name__}: {e}"[:300]
                self._stop.wait(self.poll_s)
        with self._lock:  # the run is over: no new reviver starts after close()
            self._reviving.discard(rep.index)

    def _rejoin(self, rep: Replica) -> bool:
        """Load the current weights into `rep` until it holds them with no push under way; then it
        serves again. What a server that was down serves is unknown (a restarted one serves the
        model it starts with, whatever version it last held), so the load is never skipped."""
        loaded = None  # the version this revival loaded into it
        for _ in range(5):
            with self._lock:
                while self._pushing and not self._stop.is_set():
                    self._lock.wait(1.0)
                version, path = self.version, self.weights_path
            if path is not None and loaded != version:
                self.load(rep, path, version)  # sets rep.versions on success
                loaded = version
            elif path is None:
                rep.versions.set(version)  # the model it starts with: the run's first weights
            with self._lock:
                if not self._pushing and rep.versions.get() == self.version:
                    rep.healthy, rep.down_reason = True, None
                    self._reviving.discard(rep.index)
                    self._lock.notify_all()
                    return True
        return False

    # -- pushes -------------------------------------------------------------------------------------

    def begin_push(self) -> list[Replica]:
        """The servers a push goes to; no replica rejoins until `end_push`."""
        with self._lock:
            while self._pushing:
                self._lock.wait(1.0)
            self._pushing = True
            return [r for r in self.replicas if r.healthy]

    def end_push(self, version: int | None, path: str | None) -> None:
        """The push is over; with a version, the serving replicas now hold `path` as `version`."""
        with self._lock:
            if version is not None:
                self.version, self.weights_path = version, path
            self._pushing = False
            self._lock.notify_all()

    # -- metrics and shutdown -----------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {"gen/servers_up": float(sum(r.healthy for r in self.replicas))}
            if len(self.replicas) > 1:
                for r in self.replicas:
                    p = f"gen/server{r.index}"
                    out |= {
                        f"{p}/up": float(r.healthy),
                        f"{p}/failures": float(r.failures),
                        f"{p}/restarts": float(r.restarts),
                        f"{p}/version": float(r.versions.get()),
                    }
            return out

    def close(self) -> None:
        """Stop reviving (the run is over); revivers exit at their next wait."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()


class Servers:
    """A ReplicaSet as generation backends inside one event loop: one client per server (index
    order). `generate_groups(servers=...)` routes each group through it."""

    def __init__(self, replicas: ReplicaSet, clients: list):
        self.replicas, self.clients = replicas, clients

    def model_name(self, version: int) -> str | None:
        """What a request generated under `version` names as its model (None: the client's own)."""
        return self.replicas.model_name(version)

    async def max_model_len(self) -> int:
        """The context length the servers share (one model): asked of the first that answers."""
        last: Exception | None = None
        for rep in self.replicas.serving() or self.replicas.replicas:
            try:
                return await self.clients[rep.index].max_model_len()
            except InferenceUnavailableError as e:
                self.replicas.down(rep, e)
                last = e
        raise InferenceUnavailableError(self.replicas.all_down()) from last
