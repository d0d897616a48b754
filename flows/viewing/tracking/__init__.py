"""Experiment trackers (`run.report_to`: TensorBoard, MLflow, W&B) as sinks of the store's `steps` table.

The Parquet store is the source of truth; a tracker only ever gets a copy of it. A step reaches the
trackers once it is *closed* (at or before the run's latest checkpoint: a resume never redoes it), read
back from the store, so what a tracker shows is the `steps` row exactly: the same metric names
(`reward/mean`), `step` as the step, `policy_version` as a metric too, NULL/NaN metrics left out (never
logged as 0). Every `run.log_samples_every` steps (and at the run's last) a table of the step's training
completions goes with it, and at the end the report's PNGs.

Exactly once: each tracker says where it stands (`logged_through`, asked of its own storage where it
can), and gets only closed steps after that, so after a kill and `--resume` no step is logged twice and
none is missing. A step's sample table goes before its metrics, and overwrites (MLflow: an artifact per
step; TensorBoard: its purge): the metrics' presence is what says the step landed.

All tracker work runs on one daemon thread fed by a queue: `Tracking.closed` returns at once, and the
training loop never waits on a tracking server. A tracker that raises (server down, disk full) is
warned about once and dropped for the rest of the run; the others and the run go on, and a resume
catches it up. What each tracker needs to continue its tracking run (ids, dirs, URI) is kept in
`<root>/tracking/<run>.json`.

Each tracker's library is imported only when the run reports to it (`check_trackers` says which extra
installs it). Here the driver; `tracker_api.py` the `Tracker` protocol and what the trackers get (step
metrics, params, sample tables); one module per tracker (`*_tracker.py`: never the library's own name).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.flows.viewing.tracking.mlflow_tracker import MlflowTracker
from grpoflow.flows.viewing.tracking.tensorboard_tracker import TensorBoardTracker
from grpoflow.flows.viewing.tracking.tracker_api import Tracker, config_params, sample_table, step_metrics
from grpoflow.flows.viewing.tracking.wandb_tracker import WandbTracker
from grpoflow.storage.rollouts import RolloutStore, atomic_write_text

# `run.report_to`'s choice -> its tracker. The choices are TRACKER_NAMES (tasks/config/choices.py), which
# the config validates against; each tracker class carries its own name, title and module, and a unit
# test holds the two lists equal (tests/unit/test_tracking.py).
TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoardTracker, MlflowTracker, WandbTracker)}


def check_trackers(cfg: GRPOConfig) -> None:
    """Every tracker in `run.report_to` must be installed (an optional extra each)."""
    for i, name in enumerate(cfg.run.report_to):
        if importlib.util.find_spec(TRACKERS[name].module) is None:
            raise ConfigError(
                f"run.report_to[{i}]: {name} is not installed: pip install 'grpoflow[{name}]' "
                "(or grpoflow[tracking] for all three; make install installs them)"
            )


class Tracking:
    """The run's trackers, fed on one daemon thread. `closed(step)`: steps <= step are final; each
    tracker gets every one it does not hold yet (with a sample table where one is due). `finish`: the
    report's PNGs, then each tracker closed, waiting at most `tracking.finish_timeout_s`."""

    def __init__(self, cfg: GRPOConfig, run_id: str, *, flow_run_id: str | None, logger: Any):
        self.cfg, self.run_id, self.flow_run_id, self.log = cfg, run_id, flow_run_id, logger
        self.store = RolloutStore(cfg.storage.root)
        self.state_path = Path(cfg.storage.root) / "tracking" / f"{run_id}.json"
        self._trackers: list[Tracker] = []  # the live ones: one that failed is dropped
        self._done: dict[str, int] = {}  # tracker -> the last step it holds
        self._logged: set[str] = set()  # trackers that got a step from this process
        self._states: dict[str, dict[str, Any]] = {}
        self._links: dict[str, str] = {}
        self._closed = -1
        self._lock = threading.Lock()
        self._busy: str | None = None  # the tracker being called, for finish's warning
        self._finishing = False
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"tracking-{run_id}", daemon=True)
        self._thread.start()

    # -- the training loop's side: never waits on a tracker --------------------------------------

    def closed(self, step: int) -> None:
        with self._lock:
            if step <= self._closed or self._finishing:
                return
            self._closed = step
        self._queue.put(("log", None))

    def finish(self, report_dir: Path | None) -> None:
        with self._lock:
            if self._finishing:
                return
            self._finishing = True
        self._queue.put(("finish", report_dir))
        timeout = self.cfg.tracking.finish_timeout_s
        self._thread.join(timeout)
        if self._thread.is_alive():  # a daemon thread: it does not hold the process up
            self.log.warning(
                "tracking: gave up waiting for the trackers after %g s (%s busy); what they missed, a "
                "resume of this run logs",
                timeout,
                self._busy or "none",
            )

    def links(self) -> dict[str, str]:
        return dict(self._links)

    # -- the tracking thread ------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self._open_all()
            while True:
                kind, arg = self._queue.get()
                self._log_closed()
                if kind == "finish":
                    self._finish_all(arg)
                    return
        except Exception as e:  # the driver's own failure (the store unreadable): the run goes on
            self.log.warning("tracking of run %s stopped: %s: %s", self.run_id, type(e).__name__, e)
            for t in list(self._trackers):
                self._close_quietly(t)
            self._trackers.clear()

    @contextlib.contextmanager
    def _guard(self, t: Tracker) -> Iterator[None]:
        """Run a tracker's calls; one that raises is warned about once and dropped for the run."""
        self._busy = t.name
        try:
            yield
        except Exception as e:
            text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            self.log.warning(
                "tracking: %s failed and is dropped for the rest of this run (the run and the other "
                "trackers go on; a resume logs the steps it missed): %s: %s",
                t.name,
                type(e).__name__,
                text,
            )
            if t in self._trackers:
                self._trackers.remove(t)
            self._close_quietly(t)
        finally:
            self._busy = None

    @staticmethod
    def _close_quietly(t: Tracker) -> None:
        with contextlib.suppress(Exception):
            t.close()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            states = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        return states if isinstance(states, dict) else {}

    def _save(self) -> None:
        atomic_write_text(self.state_path, json.dumps(self._states, indent=2, sort_keys=True))

    def _open_all(self) -> None:
        self._states = self._load()  # a tracker that fails keeps its state: a resume continues its run
        tags = {"grpoflow.run_id": self.run_id, "grpoflow.lineage": self.run_id}
        if self.flow_run_id:
            tags["grpoflow.flow_run_id"] = self.flow_run_id
        params: dict[str, str] | None = None
        for name in dict.fromkeys(self.cfg.run.report_to):
            t: Tracker = TRACKERS[name](self.cfg, self.run_id)
            self._trackers.append(t)
            with self._guard(t):
                prior = self._states.get(name) or {}
                state = t.open(prior or None)
                # Recorded before anything else reaches it: a kill from here on (another tracker's slow
                # start included) resumes this tracking run instead of starting a second one; `setup`
                # False says its params and tags may not all be in yet.
                self._states[name] = {**state, "setup": False}
                self._save()
                self._done[name] = t.logged_through()
                if t.new or not prior.get("setup", True):
                    # The run's own id, not the launch's `run.run_id` (None on a --resume): a resume that
                    # completes an interrupted setup logs the very values the first launch did (MLflow
                    # refuses a param that changes).
                    params = (
                        params
                        if params is not None
                        else config_params(self.cfg) | {"run.run_id": self.run_id}
                    )
                    t.log_params(params)
                t.set_tags(tags)
                self._links[name] = t.link()
                self._states[name] = state  # params and tags are in
        self._save()

    def _samples_due(self, step: int) -> bool:
        every = self.cfg.run.log_samples_every
        return bool(every) and ((step + 1) % every == 0 or step == self.cfg.run.steps - 1)

    def _log_closed(self) -> None:
        with self._lock:
            through = self._closed
        if not any(self._done[t.name] < through for t in self._trackers):
            return
        after = min(self._done[t.name] for t in self._trackers)
        rows = sorted(
            (r for r in self.store.read_steps(self.run_id) if after < r["step"] <= through),
            key=lambda r: r["step"],
        )
        for row in rows:
            step = row["step"]
            targets = [t for t in self._trackers if self._done[t.name] < step]
            if not targets:
                continue
            table = None
            if self._samples_due(step):
                groups = self.store.read_groups(self.run_id, step, split="train")
                table = sample_table(groups) if groups else None
            metrics, wall_time = step_metrics(row), row["created_at"].timestamp()
            for t in targets:
                with self._guard(t):
                    if table is not None:  # before the metrics: their presence says the step landed
                        t.log_table(step, *table)
                    t.log_step(step, metrics, wall_time)
                    self._done[t.name] = step
                    self._logged.add(t.name)
        for t in list(self._trackers):
            with self._guard(t):
                self._states[t.name] = t.flush()
        self._save()

    def _finish_all(self, report_dir: Path | None) -> None:
        pngs = sorted(Path(report_dir).glob("*.png")) if report_dir is not None else []
        for t in list(self._trackers):
            with self._guard(t):
                # Only with steps of this process: a resume of a finished run that had nothing to catch
                # up would show the plots twice.
                if pngs and t.name in self._logged:
                    t.log_images(pngs)
                # The state after `close`: W&B holds a session's steps for sure only once its run finished.
                self._states[t.name] = t.close()
            if t in self._trackers:
                self._trackers.remove(t)
        self._save()


def tracking(
    cfg: GRPOConfig, run_id: str, *, flow_run_id: str | None = None, logger: Any = None
) -> Tracking | None:
    """The run's `Tracking`, or None when `run.report_to` is empty (no tracker library is imported)."""
    if not cfg.run.report_to:
        return None
    return Tracking(
        cfg, run_id, flow_run_id=flow_run_id, logger=logger or logging.getLogger("grpoflow.tracking")
    )
