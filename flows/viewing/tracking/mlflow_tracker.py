"""The MLflow tracker: a run at an MLflow tracking server or the store's own SQLite backend (mlflow
imported only when a run reports to MLflow)."""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Any

from grpoflow.flows.config import GRPOConfig

_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- ]")


def _mlflow_key(k: str) -> str:
    """`k` as MLflow accepts a metric or param name: characters it refuses (anything but letters, digits,
    `_ - . / space`) become `_`, and a name that would resolve to another path (`a//b`, `x/`) loses its
    slashes. Names grpoflow writes pass unchanged."""
    k = _MLFLOW_BAD_CHARS.sub("_", k)[:250]
    if posixpath.normpath(k) != k or k.startswith(".."):
        k = k.replace("/", "_")
    return k


def local_mlflow_uri(root: str | Path) -> str:
    """The store's own MLflow backend: SQLite at <root>/mlflow/mlflow.db. MLflow 3.17 refuses a `file:`
    (./mlruns) store unless MLFLOW_ALLOW_FILE_STORE is set, as it is in maintenance mode, and
    recommends a database backend, SQLite for a local one."""
    return "sqlite:///" + str((Path(root) / "mlflow" / "mlflow.db").resolve())


class MlflowTracker:
    """A run in `tracking.mlflow_experiment` at `tracking.mlflow_tracking_uri`, else $MLFLOW_TRACKING_URI,
    else the store's own SQLite backend (`local_mlflow_uri`; artifacts beside the database, under
    <root>/mlflow/artifacts, not in the current directory's ./mlruns). A step's metrics are one
    `log_batch` (timestamp: the row's created_at), `policy_version` last, so its history is where the run
    stands. Sample tables are JSON artifacts `samples/step-NNNNNN.json` in `log_table`'s format
    ({"columns", "data"}) written by `log_dict`: `log_table` appends to an existing file (a re-log after a
    kill would double its rows) and lists every table in one run tag, which outgrows MLflow's tag size
    limit on a long run. A dead server fails each call within seconds (one retry, 5 s timeout, unless
    MLFLOW_HTTP_REQUEST_* say otherwise)."""

    name, title, module = "mlflow", "MLflow", "mlflow"

    def __init__(self, cfg: GRPOConfig, run_id: str):
        self.root = Path(cfg.storage.root)
        self.run_name = run_id
        self.uri = (
            cfg.tracking.mlflow_tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or local_mlflow_uri(self.root)
        )
        self.experiment = cfg.tracking.mlflow_experiment
        self.client: Any = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.new = True

    def _sqlite_dir(self) -> Path | None:
        if not self.uri.startswith("sqlite:///"):
            return None
        return Path(self.uri[len("sqlite:///") :].split("?", 1)[0]).resolve().parent

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]:
        # Read at each request: set before the first, so a dead server costs seconds, not minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        from mlflow.tracking import MlflowClient

        if (db_dir := self._sqlite_dir()) is not None:
            db_dir.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its directory
        self.client = MlflowClient(self.uri)
        if state and state.get("uri") == self.uri and state.get("run_id"):
            self.run_id = state["run_id"]
            self.experiment_id = self.client.get_run(self.run_id).info.experiment_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.new = False
        else:  # a new run (the state, if any, names a run in another store)
            self.experiment_id = self._experiment_id()
            self.run_id = self.client.create_run(self.experiment_id, run_name=self.run_name).info.run_id
            self.new = True
        return {"uri": self.uri, "run_id": self.run_id, "experiment_id": self.experiment_id}

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        db_dir = self._sqlite_dir()
        try:
            return self.client.create_experiment(
                self.experiment, artifact_location=(db_dir / "artifacts").as_uri() if db_dir else None
            )
        except MlflowException:  # another run created it meanwhile
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def logged_through(self) -> int:
        return max(
            (m.step for m in self.client.get_metric_history(self.run_id, "policy_version")), default=-1
        )

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        keyed: dict[str, str] = {}
        for k, v in params.items():
            keyed.setdefault(_mlflow_key(k), v[:MAX_PARAM_VAL_LENGTH])
        items = [Param(k, v) for k, v in keyed.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        self.client.log_batch(self.run_id, tags=[RunTag(k, v[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()])

    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        ms = round(wall_time * 1000)
        keyed: dict[str, float] = {}
        for k in sorted(metrics, key=lambda k: k == "policy_version"):  # policy_version last
            keyed.setdefault(_mlflow_key(k), metrics[k])
        items = [Metric(k, v, ms, step) for k, v in keyed.items()]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])

    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"samples/step-{step:06d}.json")

    def log_images(self, paths: list[Path]) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p), "report")

    def flush(self) -> dict[str, Any]:
        return {"uri": self.uri, "run_id": self.run_id, "experiment_id": self.experiment_id}

    def link(self) -> str:
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        db_dir = self._sqlite_dir()
        return str(db_dir) if db_dir is not None else self.uri

    def close(self) -> dict[str, Any]:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")
        return self.flush()
