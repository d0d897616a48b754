"""Prefect's temporary API server for a local run, started and owned by grpoflow; a bounded exit when
a configured Prefect API stops answering.

Without `PREFECT_API_URL`, Prefect starts a temporary API server of its own and stops it at exit, which
a SIGKILLed or OOM-killed run never reaches: the server lives on. grpoflow starts the same server
(the same uvicorn app and settings) under its guard instead, so it dies with the run however the run
dies, and points this process's Prefect settings at it.

With `PREFECT_API_URL` set (a Prefect server on another host), a run goes on when that server dies: the
store, not Prefect, holds its tables. But Prefect sends the run's queued logs and events before the
process may exit, each with its own retries and the queue growing with every failed one, which takes
hours once the server is gone. A command gives them `exit_drain_s()` (30 s, or `GRPOFLOW_PREFECT_DRAIN_S`);
what is still queued then is dropped, said so on stderr, and the command exits with its own code
(`undelivered`, flows/cli/main.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpoflow.flows.processes.launch import ServerHandle, free_port, guarded_command


@contextlib.contextmanager
def owned_prefect_api(startup_timeout_s: float = 120.0) -> Iterator[str | None]:
    """The configured Prefect API if there is one (yields None), else a guarded temporary server for
    the duration of the block (yields its URL)."""
    import prefect
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if PREFECT_API_URL.value():
        drain_s = exit_drain_s()  # a bad value fails before the command runs, not at its exit
        try:
            yield None
        finally:
            pending = _drain_prefect_workers(drain_s)
            if pending:
                _undelivered.append(
                    f"the Prefect API at {PREFECT_API_URL.value()} took not all of this run's logs and events "
                    f"within {drain_s:g} s ({pending} of Prefect's senders still busy): they are dropped; "
                    "the run's tables are all in the store"
                )
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        # What Prefect's own temporary server sets (prefect 3.9,
        # prefect.server.api.server.SubprocessASGIServer._run_uvicorn_command): no UI; ephemeral mode
        # (create_app runs only the services meant for a temporary server, and telemetry reports it as
        # one); "final" (the last app this process builds: create_app frees the router copies it no
        # longer needs). The two double-underscore variables are Prefect-internal, but no public way
        # exists: uvicorn's --factory calls create_app() without arguments, create_app reads them in
        # place of its `ephemeral`/`final` parameters, no setting maps to them, and `prefect server
        # start` has no ephemeral flag (`--no-services` is the webserver-only mode); it sets
        # PREFECT__SERVER_FINAL the same way (prefect.cli._server_utils, its background start).
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }
    args = [
        "--app-dir",
        str(prefect.__module_path__.parent),
        "--factory",
        "prefect.server.api.server:create_app",
    ]
    args += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    log = Path(tempfile.gettempdir()) / f"grpoflow-prefect-api-{os.getpid()}.log"
    cmd = guarded_command(sys.executable, "uvicorn", args)
    server = ServerHandle(cmd, env, url, log, startup_timeout_s).start()  # health: <url>/health
    try:
        os.environ["PREFECT_API_URL"] = url  # for anything that reads the environment, children too
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain_prefect_workers(10.0)  # logs and events still queued go out before the server stops
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
    log.unlink(missing_ok=True)  # after a clean exit only: a failed run's log stays to be read


def completed_without_api(root: str | Path, run_id: str, error: BaseException) -> str | None:
    """What to say of a run whose flow raised `error`, a network error from the Prefect API (its server
    died), after the run completed (its record says so, every step in the store); None otherwise."""
    import httpx

    from grpoflow.storage.rollouts import RolloutStore

    if not isinstance(error, httpx.TransportError):
        return None
    store = RolloutStore(Path(root))
    meta = store.read_run_meta(run_id) or {}
    if meta.get("status") != "completed":
        return None
    steps = len(store.steps_written("steps", run_id))
    print(
        f"warning: the Prefect API did not record the end of run {run_id}'s flow run ({type(error).__name__}: "
        f"{error}); the run completed",
        file=sys.stderr,
    )
    return f"run {run_id}: completed, {steps} steps in the store {Path(root).resolve()}"


def settle_flow_runs(root: str | Path) -> list[str]:
    """Flow runs that the configured Prefect API still shows Running although the store says their run
    ended (the API's server was down when it did, so no final state reached it), set to what the store
    knows: the run's last flow run to its ending (completed, failed, cancelled), an earlier one, which a
    resume took over, to Crashed. Returns the ids settled. Best effort: an API that does not answer
    leaves them as they are, and the next command tries again."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Completed, Crashed, Failed

    from grpoflow.storage.rollouts import RolloutStore

    endings = {"completed": Completed, "failed": Failed, "cancelled": Cancelled}
    ended: dict[str, tuple[str, Any]] = {}  # flow run id -> (run id, the state it should have)
    store = RolloutStore(Path(root))
    for run_id in store.runs():
        meta = store.read_run_meta(run_id) or {}
        ending, flow_runs = endings.get(meta.get("status")), meta.get("flow_runs") or []
        if ending is not None:
            ended.update({f: (run_id, Crashed) for f in flow_runs[:-1]})
            ended.update({f: (run_id, ending) for f in flow_runs[-1:]})
    if not ended:
        return []
    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    settled = []
    try:
        with get_client(sync_client=True) as client:
            ids = FlowRunFilterId(any_=[UUID(f) for f in ended])
            for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=ids, state=running)):
                run_id, state = ended[str(fr.id)]
                message = (
                    f"grpoflow's store records that run {run_id} ended while this API could not be reached"
                )
                client.set_flow_run_state(fr.id, state(message=message), force=True)
                settled.append(str(fr.id))
    except Exception as e:  # an API that is down again: nothing is lost, the store is the record
        print(f"warning: could not settle stale flow runs on the Prefect API: {e}", file=sys.stderr)
    return settled


# How long a command's last logs and events may take to reach a configured Prefect API (module doc).
EXIT_DRAIN_S = 30.0
DRAIN_ENV = "GRPOFLOW_PREFECT_DRAIN_S"


def exit_drain_s() -> float:
    """`GRPOFLOW_PREFECT_DRAIN_S` (seconds, at least 0) if set, else `EXIT_DRAIN_S`: how long a command
    waits at its exit for Prefect's senders when the configured API stops answering."""
    from grpoflow.flows.config import ConfigError

    raw = os.environ.get(DRAIN_ENV)
    if raw is None or not raw.strip():
        return EXIT_DRAIN_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{DRAIN_ENV}={raw!r}: must be a number of seconds, 0 or more")
    return value


_undelivered: list[str] = []


def undelivered() -> str | None:
    """Why this process must not wait for Prefect's senders at exit (their API stopped answering), or
    None: then a normal exit sends nothing more."""
    return _undelivered[-1] if _undelivered else None


def _drain_prefect_workers(timeout_s: float) -> int:
    """Send the logs and events Prefect still has queued, waiting at most `timeout_s` in all; how many
    of its senders are still busy then (0 also when an earlier drain already gave up on them)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    if _undelivered:  # an enclosing command's drain, after this one gave up: nothing to wait for twice
        return 0
    pending, deadline = 0, time.monotonic() + timeout_s
    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # a worker that never started has nothing to drain
            _, busy = worker.drain_all(timeout=max(0.1, deadline - time.monotonic()), at_exit=False)
            pending += len(busy)
    return pending
