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
step; TensorBoard: the purge below): the metrics' presence is what says the step landed.

All tracker work runs on one daemon thread fed by a queue: `Tracking.closed` returns at once, and the
training loop never waits on a tracking server. A tracker that raises (server down, disk full) is
warned about once and dropped for the rest of the run; the others and the run go on, and a resume
catches it up. What each tracker needs to continue its tracking run (ids, dirs, URI) is kept in
`<root>/tracking/<run>.json`.

Each tracker's library is imported only when the run reports to it (`check_trackers` says which extra
installs it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import posixpath
import queue
import re
import secrets
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.storage.records import RolloutGroup
from grpoflow.storage.rollouts import RolloutStore, atomic_write_text

# The `steps` columns that are no metric (policy_version is a column and a metric).
NOT_METRICS = ("run_id", "step", "created_at")

# Columns of a sample table before the per-reward ones (`<reward>/status`, `<reward>/value`).
SAMPLE_COLUMNS = ["group", "sample", "prompt", "completion", "reward", "reward_valid", "advantage", "trained"]


class Tracker(Protocol):
    """One tracker. `open` starts a new tracking run (`state` None) or continues the one `state` names,
    and returns the state to persist; `new` says whether it started one (params go only to a new one).
    `flush` makes what was logged durable and returns the state to persist."""

    name: str
    new: bool

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]: ...
    def logged_through(self) -> int: ...
    def log_params(self, params: dict[str, str]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None: ...
    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...
    def log_images(self, paths: list[Path]) -> None: ...
    def flush(self) -> dict[str, Any]: ...
    def link(self) -> str: ...
    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# What the trackers get: a step's metrics, the config as params, a step's sample table


def step_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A `steps` row's metrics: every numeric column but the row's identity, NULL and NaN left out."""
    out = {}
    for k, v in row.items():
        if k in NOT_METRICS or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            continue
        out[k] = float(v)
    return out


def _callable_path(obj: Any) -> str:
    # As flows/runs.py records a callable given from Python (a reward, tool or environment).
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def config_params(cfg: GRPOConfig) -> dict[str, str]:
    """The config as flat params: dotted keys (`learner.lr`, `rewards.0.name`), values as text (JSON for
    anything but a string; a list of plain values is one param)."""
    out: dict[str, str] = {}

    def walk(key: str, v: Any) -> None:
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                walk(f"{key}.{k}" if key else str(k), sub)
        elif isinstance(v, list) and any(isinstance(x, dict | list) for x in v):
            for i, sub in enumerate(v):
                walk(f"{key}.{i}", sub)
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)

    walk("", cfg.model_dump(mode="json", fallback=_callable_path))
    return out


def _cell(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def sample_table(groups: list[RolloutGroup]) -> tuple[list[str], list[list[Any]]]:
    """A step's training completions, one row each: prompt, completion, reward, its validity, advantage,
    whether it was trained on, and each reward function's status and value (eval groups left out)."""
    train = [g for g in groups if g.split == "train"]
    names = list(dict.fromkeys(cell.name for g in train for c in g.completions for cell in c.reward_cells))
    columns = SAMPLE_COLUMNS + [f"{n}/{part}" for n in names for part in ("status", "value")]
    rows = []
    for g in train:
        for c in g.completions:
            cells = {cell.name: cell for cell in c.reward_cells}
            row = [g.group_id, c.sample_index, g.prompt_of(c), c.completion, _cell(c.reward), c.reward_valid,
                   _cell(c.advantage), c.trained]  # fmt: skip
            for n in names:
                cell = cells.get(n)
                row += [cell.status, _cell(cell.value)] if cell is not None else [None, None]
            rows.append(row)
    return columns, rows


def _md_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(_md_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# TensorBoard


class TensorBoardTracker:
    """Event files under <root>/tensorboard/<run> (torch's SummaryWriter). Scalars are TensorBoard's
    float32 `simple_value`s (the only scalar type its data server plots: the table's float64 values,
    rounded to float32). Where it stands is the cursor kept in the state after each flush; a continue
    writes a purge at cursor + 1 (`purge_step`), so steps a killed process wrote after its last recorded
    flush are hidden and their re-log is what readers show. The config goes in as a `config` text once,
    each session's tags as a `grpoflow` text, sample tables as `samples` markdown texts, and the
    report's PNGs as images at the last step."""

    name = "tensorboard"

    def __init__(self, cfg: GRPOConfig, run_id: str):
        self.logdir = Path(cfg.storage.root) / "tensorboard" / run_id
        self.cursor = -1  # the last step flushed to the event files
        self._last = -1  # the last step logged
        self.new = True
        self.writer: Any = None

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        self.cursor = self._last = int((state or {}).get("cursor", -1))
        self.new = self.cursor < 0  # nothing held yet: the config too is written (again)
        written = self.logdir.is_dir() and any(self.logdir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=self.cursor + 1 if written else None)
        return self._state()

    def _state(self) -> dict[str, Any]:
        return {"logdir": str(self.logdir), "cursor": self.cursor}

    def logged_through(self) -> int:
        return self.cursor

    def log_params(self, params: dict[str, str]) -> None:
        self.writer.add_text(
            "config", markdown_table(["key", "value"], [[k, v] for k, v in params.items()]), 0
        )

    def set_tags(self, tags: dict[str, str]) -> None:
        # One per session, at the last step held when it started (below its purge, so it stays, and never
        # past the run's last step): which flow run went on from where.
        table = markdown_table(["tag", "value"], [[k, v] for k, v in tags.items()])
        self.writer.add_text("grpoflow", table, max(self.cursor, 0))

    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step, walltime=wall_time)
        self._last = step

    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text("samples", markdown_table(columns, rows), step)

    def log_images(self, paths: list[Path]) -> None:
        from matplotlib.image import imread

        for p in paths:
            self.writer.add_image(f"report/{p.stem}", imread(p), max(self._last, 0), dataformats="HWC")

    def flush(self) -> dict[str, Any]:
        self.writer.flush()
        self.cursor = self._last
        return self._state()

    def link(self) -> str:
        return str(self.logdir)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------------------------------
# MLflow

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

    name = "mlflow"

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

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")


# ---------------------------------------------------------------------------------------------
# Weights & Biases

_LOG_HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")  # crc32 of type + data, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_log_records(path: Path) -> Iterator[bytes]:
    """The records of a `.wandb` transaction log: W&B's header, then LevelDB's log format (32 KiB blocks
    of records, each checksummed with zlib's crc32 over its type byte and data; a record split across
    blocks as first/middle/last). wandb 0.31 no longer ships a Python reader of its own (the old
    `wandb.sdk.internal.datastore`), so this is the format as its writer, wandb-core, lays it out. A
    torn tail (a killed writer) ends the log: what is before it stands."""
    data = path.read_bytes()
    if len(data) < _LOG_HEADER.size or data[:4] != b":W&B":
        return
    pos, parts = _LOG_HEADER.size, []
    while pos + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:  # a block's zero trailer
            pos += left
            continue
        crc, n, kind = _RECORD_HEADER.unpack_from(data, pos)
        body = data[pos + _RECORD_HEADER.size : pos + _RECORD_HEADER.size + n]
        if len(body) < n or zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
            return
        pos += _RECORD_HEADER.size + n
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = [body]
        elif kind == _MIDDLE:
            parts.append(body)
        elif kind == _LAST:
            yield b"".join([*parts, body])
            parts = []


def wandb_log_files(path: str | Path, wandb_id: str | None = None) -> list[Path]:
    """The `.wandb` logs under `path` (a log, a run directory, a wandb directory or any folder above),
    of run `wandb_id` only if given, each session once (not again through `latest-run`), oldest first."""
    p = Path(path)
    if p.is_file():
        return [p]
    pattern = f"run-{wandb_id}.wandb" if wandb_id else "run-*.wandb"
    seen, files = set(), []
    for f in p.rglob(pattern):
        st = f.stat()
        if f.parent.is_symlink() or (st.st_ino, st.st_dev) in seen:
            continue
        seen.add((st.st_ino, st.st_dev))
        files.append(f)
    # Session dirs are named [offline-]run-<YYYYmmdd_HHMMSS>-<id>[-<n> when one started the same second].
    return sorted(files, key=lambda f: (f.parent.name.removeprefix("offline-"), len(f.parent.name)))


def wandb_history_rows(path: str | Path, wandb_id: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """Every history row in the `.wandb` logs under `path` (see `wandb_log_files`), in log order: (step,
    {key: value}), values decoded from their JSON, a logged dict (a table's reference) as a dict."""
    from wandb.proto.wandb_internal_pb2 import Record

    rows = []
    for f in wandb_log_files(path, wandb_id):
        for body in _wandb_log_records(f):
            record = Record.FromString(body)
            if record.WhichOneof("record_type") != "history":
                continue
            row: dict[str, Any] = {}
            for item in record.history.item:
                keys = list(item.nested_key) or [item.key]
                at = row
                for k in keys[:-1]:
                    at = at.setdefault(k, {})
                at[keys[-1]] = json.loads(item.value_json)
            rows.append((record.history.step.num, row))
    return rows


def wandb_history(path: str | Path, wandb_id: str | None = None) -> dict[int, dict[str, Any]]:
    """The history of the W&B run(s) under `path`: step -> {key: value}, across resumed sessions."""
    out: dict[int, dict[str, Any]] = {}
    for step, row in wandb_history_rows(path, wandb_id):
        out.setdefault(step, {}).update(row)
    return out


def _new_wandb_id(run_id: str) -> str:
    # Random suffix: a W&B id once used (even by a deleted run, or another store's run of the same
    # name) cannot start a fresh run.
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_id)[:56]}-{secrets.token_hex(4)}"


class WandbTracker:
    """A W&B run under <root>/wandb/<run>, offline unless `tracking.wandb_mode` or $WANDB_MODE say
    otherwise. Where it stands is read from the run's own transaction logs (`wandb_history`): a
    continue is another session with the same id (offline: another `offline-run-*` directory beside
    the first); `wandb sync <root>/wandb/<run>/wandb` uploads every session of it, in order of start
    time, into the one run. wandb's console is off, and `close` ends its service process."""

    name = "wandb"

    def __init__(self, cfg: GRPOConfig, run_id: str):
        t = cfg.tracking
        self.run_name = run_id
        self.dir = Path(cfg.storage.root) / "wandb" / run_id
        self.mode = t.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        self.project, self.entity = t.wandb_project, t.wandb_entity
        self.id: str | None = None
        self.run: Any = None
        self.cursor = self._last = -1
        self.new = True

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        self.new = not (state and state.get("id"))
        self.id = _new_wandb_id(self.run_name) if self.new else state["id"]  # type: ignore[index]
        history = wandb_history(self.dir, self.id) if self.dir.is_dir() else {}
        self.cursor = self._last = max(
            (s for s, row in history.items() if "policy_version" in row), default=-1
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=self.id,
            name=self.run_name,
            dir=str(self.dir),
            mode=self.mode,
            resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )
        return self.flush()

    def logged_through(self) -> int:
        return self.cursor

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.run.tags = tuple(f"{k}={v}"[:64] for k, v in tags.items())  # W&B's tag length limit
        self.run.config.update(tags, allow_val_change=True)  # in full

    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self.run.log(metrics, step=step)
        self._last = step

    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        import wandb

        self.run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def log_images(self, paths: list[Path]) -> None:
        import wandb

        # At the last step (W&B's steps only grow: a later one would hide the next session's steps).
        self.run.log({f"report/{p.stem}": wandb.Image(str(p)) for p in paths}, step=max(self._last, 0))

    def flush(self) -> dict[str, Any]:
        return {"id": self.id, "dir": str(self.dir), "mode": self.mode, "project": self.project,
                "entity": self.entity}  # fmt: skip

    def link(self) -> str:
        url = getattr(self.run, "url", None) if self.mode == "online" else None
        return url or str(self.dir / "wandb")

    def close(self) -> None:
        import wandb

        try:
            if self.run is not None:
                self.run.finish()
        finally:
            wandb.teardown()  # the wandb-core service would otherwise live as long as the process


TRACKERS: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}

# The module each tracker needs (torch's SummaryWriter writes through the `tensorboard` package).
_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check_trackers(cfg: GRPOConfig) -> None:
    """Every tracker in `run.report_to` must be installed (an optional extra each)."""
    for i, name in enumerate(cfg.run.report_to):
        if importlib.util.find_spec(_MODULES[name]) is None:
            raise ConfigError(
                f"run.report_to[{i}]: {name} is not installed: pip install 'grpoflow[{name}]' "
                "(or grpoflow[tracking] for all three; make install installs them)"
            )


# ---------------------------------------------------------------------------------------------
# The driver


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
                    params = params if params is not None else config_params(self.cfg)
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
                self._states[t.name] = t.flush()
                t.close()
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
