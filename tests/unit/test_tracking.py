"""Trackers as sinks of the `steps` table (flows/viewing/tracking/), with the real libraries and their own
readers: TensorBoard's event files through TensorBoard's EventAccumulator, MLflow through its client on
a local SQLite store, W&B offline through its transaction logs (tests/support_wandb.py). What each
holds is the steps table exactly (TensorBoard: to float32, its scalar type); a continue logs each step
once, a TensorBoard re-log after a kill shows only the new values, a W&B session killed before its run
finished loses no step; a failing tracker is warned about once and the others go on; a tracker that is
not installed is named with its extra."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from grpoflow.flows.config import ConfigError, load_config
from grpoflow.flows.viewing.tracking import TRACKERS, check_trackers, tracking
from grpoflow.flows.viewing.tracking.mlflow_tracker import MlflowTracker, _mlflow_key, local_mlflow_uri
from grpoflow.flows.viewing.tracking.tracker_api import config_params, sample_table, step_metrics
from grpoflow.flows.viewing.tracking.wandb_tracker import WandbTracker
from grpoflow.storage.records import RewardCell
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.choices import TRACKER_NAMES
from tests.support import make_groups
from tests.support_wandb import wandb_history, wandb_history_rows, wandb_log_files

pytestmark = pytest.mark.unit

RUN = "track-1"
STEPS = 6
SAMPLES_EVERY = 4  # a sample table at step 3, and at the last step (5: no rollouts there, so none)
SAMPLES_STEP = 3


class ListLogger:
    """The run logger's interface, keeping what it is told."""

    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, msg, *args):
        self.warnings.append(msg % args)

    def info(self, msg, *args):
        pass

    debug = info


@pytest.fixture(scope="module", autouse=True)
def _quiet_wandb(tmp_path_factory):
    """W&B stages tables and writes its core logs outside the run's dir: under this module's tmp here."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(var, str(home / var.lower()))
        for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI"):
            mp.delenv(var, raising=False)
        yield


def _metrics(step: int, shift: float = 0.0) -> dict:
    return {
        "policy_version": step,
        "reward/mean": step / 3 + shift,  # not exact in float32: TensorBoard gets it rounded
        "reward/valid_frac": 1.0 - step / 7,
        "train/loss": None if step == 2 else 0.1 * step - shift,  # NULL: left out, not logged as 0
        "eval/reward_mean": 0.5 + shift if step == STEPS - 1 else None,
    }


def _write_store(root: Path, steps=range(STEPS), shift: float = 0.0) -> None:
    store = RolloutStore(root)
    for s in steps:
        store.write_step(RUN, s, _metrics(s, shift))
    groups = make_groups(2, 3)
    for g in groups:
        for c in g.completions:
            c.reward, c.reward_valid = float(c.sample_index), c.sample_index != 2
            c.advantage, c.trained = c.sample_index - 1.0, True
            c.reward_cells = [RewardCell("len", c.reward if c.reward_valid else None,
                                         "valid" if c.reward_valid else "failed")]  # fmt: skip
    held_out = make_groups(1, 2)[0]
    held_out.group_id, held_out.split = "eval-g0", "eval"  # never in a sample table
    store.write_rollouts(RUN, SAMPLES_STEP, [*groups, held_out])
    store.write_rewards(RUN, SAMPLES_STEP, [*groups, held_out])


def _expected(root: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: step_metrics(r) for r in RolloutStore(root).read_steps(RUN)}


def _overrides(root: Path, *report_to: str, **sets) -> list[str]:
    return [f"storage.root={root}", f"run.report_to={json.dumps(list(report_to))}", f"run.steps={STEPS}",
            f"run.log_samples_every={SAMPLES_EVERY}"] + [f"{k}={v}" for k, v in sets.items()]  # fmt: skip


def _cfg(root: Path, *report_to: str, **sets):
    return load_config(None, _overrides(root, *report_to, **sets))


def _state(root: Path) -> dict:
    return json.loads((root / "tracking" / f"{RUN}.json").read_text())


def _write_png(path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1], [1, 0])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def _wandb_children() -> list[str]:
    return [p.name() for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]


# -- readers, each the tracker's own ---------------------------------------------------------------


def _tb(root: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    size = {"scalars": 0, "tensors": 0, "images": 0}
    return EventAccumulator(str(root / "tensorboard" / RUN), size_guidance=size).Reload()


def _tb_scalars(ea) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def _tb_text(ea, tag: str) -> list[tuple[int, str]]:
    from tensorboard.util import tensor_util

    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in ea.Tensors(tag)]


def _by_key(expected: dict[int, dict[str, float]], as_float32: bool = False) -> dict[str, list]:
    """Each metric's (step, value) series, as a tracker's reader gives them (TensorBoard: float32)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(expected):
        for k, v in expected[step].items():
            out.setdefault(k, []).append((step, float(np.float32(v)) if as_float32 else v))
    return out


def _samples(root: Path) -> dict:
    """The sample table of SAMPLES_STEP, as the store has it: train groups only, one row per completion."""
    columns, rows = sample_table(RolloutStore(root).read_groups(RUN, SAMPLES_STEP))
    assert columns[:4] == ["group", "sample", "prompt", "completion"] and columns[-2:] == [
        "len/status",
        "len/value",
    ]
    assert len(rows) == 6 and {r[0] for r in rows} == {"g0", "g1"}
    return {"columns": columns, "data": rows}


def _mlflow(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(local_mlflow_uri(root))


def _mlflow_series(client, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _wandb_logged(root: Path) -> dict[int, dict[str, float]]:
    """Each W&B history row's metrics (W&B's own `_` keys, tables and images left out), by step; a step
    logged twice fails."""
    out: dict[int, dict[str, float]] = {}
    for step, row in wandb_history_rows(root / "wandb" / RUN):
        metrics = {k: v for k, v in row.items() if not k.startswith("_") and not isinstance(v, dict)}
        if metrics:
            assert step not in out, f"W&B holds step {step} twice"
            out[step] = metrics
    return out


# -- one run logged to all three, shared by the tests that read it back ----------------------------


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    _write_store(root)
    _write_png(root / "report" / "reward.png")
    cfg = _cfg(root, "tensorboard", "mlflow", "wandb")
    log = ListLogger()
    t = tracking(cfg, RUN, flow_run_id="flow-run-1", logger=log)
    t.closed(2)
    t.closed(STEPS - 1)
    t.finish(root / "report")
    return SimpleNamespace(root=root, cfg=cfg, log=log, links=t.links(), expected=_expected(root),
                           wandb_left=_wandb_children())  # fmt: skip


def test_tensorboard_holds_the_steps_table(logged):
    ea = _tb(logged.root)
    # every step once, NULLs left out, policy_version a metric too
    assert _tb_scalars(ea) == _by_key(logged.expected, as_float32=True)
    assert [s for s, _ in _tb_text(ea, "samples/text_summary")] == [SAMPLES_STEP]
    (_, samples), = _tb_text(ea, "samples/text_summary")  # fmt: skip
    assert samples.count("<prompt") == 6 and "eval-g0" not in samples and "len/status" in samples
    (_, config), = _tb_text(ea, "config/text_summary")  # fmt: skip
    assert f"| learner.lr | {logged.cfg.learner.lr} |" in config
    assert "flow-run-1" in _tb_text(ea, "grpoflow/text_summary")[0][1]
    image = ea.Images("report/reward")
    assert [e.step for e in image] == [STEPS - 1] and image[0].width == 100


def test_mlflow_holds_the_steps_table(logged):
    client = _mlflow(logged.root)
    run_id = _state(logged.root)["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == RUN
    want = _by_key(logged.expected)
    assert _mlflow_series(client, run_id, want) == want
    assert set(run.data.metrics) == set(want)
    created = {r["step"]: r["created_at"] for r in RolloutStore(logged.root).read_steps(RUN)}
    for m in client.get_metric_history(run_id, "reward/mean"):  # the row's own time, in ms
        assert m.timestamp == round(created[m.step].timestamp() * 1000)
    params = config_params(logged.cfg) | {"run.run_id": RUN}  # the run's own id, whatever launched it
    assert run.data.params["learner.lr"] == params["learner.lr"] == str(logged.cfg.learner.lr)
    assert run.data.params == params
    assert {k: v for k, v in run.data.tags.items() if k.startswith("grpoflow.")} == {
        "grpoflow.run_id": RUN, "grpoflow.lineage": RUN, "grpoflow.flow_run_id": "flow-run-1"}  # fmt: skip
    samples = f"samples/step-{SAMPLES_STEP:06d}.json"
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == [samples]
    table = json.loads(Path(client.download_artifacts(run_id, samples)).read_text())
    assert table == _samples(logged.root)
    assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/reward.png"]
    # artifacts live in the store, not in the current directory's ./mlruns
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(logged.root / "mlflow")


def test_wandb_holds_the_steps_table(logged):
    assert _wandb_logged(logged.root) == logged.expected
    history = wandb_history(logged.root / "wandb" / RUN)
    ref = history[SAMPLES_STEP]["samples"]
    assert ref["_type"] == "table-file" and ref["nrows"] == 6
    (session,) = {f.parent for f in wandb_log_files(logged.root / "wandb" / RUN)}
    table = json.loads((session / "files" / ref["path"]).read_text())
    assert {k: table[k] for k in ("columns", "data")} == _samples(logged.root)
    assert not any("samples" in history[s] for s in history if s != SAMPLES_STEP)
    assert history[STEPS - 1]["report/reward"]["_type"] == "image-file"
    runs = [rec["run"] for rec in map(json.loads, _leet(session)) if rec["type"] == "run"]  # then updates
    assert runs[0]["display_name"] == RUN and "grpoflow.run_id=track-1" in runs[-1]["tags"]
    assert runs[-1]["config"]["update"]["learner.lr"] == str(logged.cfg.learner.lr)


def _leet(path: Path) -> list[str]:
    """wandb's own reader of a transaction log (`wandb leet inspect --json`, run by wandb-core)."""
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return out.stdout.splitlines()


def test_wandb_reader_agrees_with_wandbs_own(logged):
    (log_file,) = wandb_log_files(logged.root / "wandb" / RUN)
    theirs = {}
    for line in _leet(log_file):
        rec = json.loads(line)
        if rec["type"] == "history":
            theirs[rec["history"]["step"].get("num", 0)] = rec["history"]["item"]
    ours = wandb_history(log_file)
    assert set(theirs) == set(ours)
    for step, row in ours.items():
        flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
        assert flat == {k: v for k, v in theirs[step].items() if "." not in k}


def test_links_state_and_no_leftovers(logged):
    assert logged.log.warnings == []
    root = logged.root
    assert logged.links == {
        "tensorboard": str(root / "tensorboard" / RUN),
        "mlflow": str((root / "mlflow").resolve()),
        "wandb": str(root / "wandb" / RUN / "wandb"),
    }
    state = _state(root)
    assert state["tensorboard"]["cursor"] == state["wandb"]["cursor"] == STEPS - 1
    assert state["wandb"]["id"].startswith(f"{RUN}-") and state["wandb"]["mode"] == "offline"
    assert logged.wandb_left == []  # close() ended W&B's service process


# -- resumes -----------------------------------------------------------------------------------------


def test_a_continue_logs_each_step_once(tmp_path):
    """Steps 0..2 closed by one process, then 0..5 by the next (a resume): 3..5 go to the same tracking
    runs, each step once; a third (a resume of the finished run) adds nothing."""
    _write_store(tmp_path)
    cfg = _cfg(tmp_path, "tensorboard", "mlflow", "wandb")
    log = ListLogger()
    first = tracking(cfg, RUN, flow_run_id="flow-a", logger=log)
    first.closed(2)
    first.finish(None)
    before = _state(tmp_path)
    assert before["tensorboard"]["cursor"] == before["wandb"]["cursor"] == 2
    second = tracking(cfg, RUN, flow_run_id="flow-b", logger=log)
    second.closed(STEPS - 1)
    _write_png(tmp_path / "report" / "reward.png")
    second.finish(tmp_path / "report")
    # A --resume of the finished run: nothing to catch up, and the plots are not shown again.
    again = tracking(cfg, RUN, flow_run_id="flow-c", logger=log)
    again.closed(STEPS - 1)
    again.finish(tmp_path / "report")
    assert log.warnings == []
    after = _state(tmp_path)
    assert after["mlflow"]["run_id"] == before["mlflow"]["run_id"]
    assert after["wandb"]["id"] == before["wandb"]["id"]

    want = _by_key(_expected(tmp_path))
    assert _tb_scalars(_tb(tmp_path)) == _by_key(_expected(tmp_path), as_float32=True)
    client = _mlflow(tmp_path)
    run_id = after["mlflow"]["run_id"]
    assert _mlflow_series(client, run_id, want) == want
    (exp,) = [e for e in client.search_experiments() if e.name == "grpoflow"]
    assert len(client.search_runs([exp.experiment_id])) == 1
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["grpoflow.flow_run_id"] == "flow-c"
    assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/reward.png"]
    ea = _tb(tmp_path)
    assert [e.step for e in ea.Images("report/reward")] == [STEPS - 1]
    sessions = [(step, text.split("flow-")[1][0]) for step, text in _tb_text(ea, "grpoflow/text_summary")]
    assert sessions == [(0, "a"), (2, "b"), (STEPS - 1, "c")]  # each session, from where it went on
    assert _wandb_logged(tmp_path) == _expected(tmp_path)
    images = [s for s, row in wandb_history_rows(tmp_path / "wandb" / RUN) if "report/reward" in row]
    assert images == [STEPS - 1]
    sessions = {f.parent for f in wandb_log_files(tmp_path / "wandb" / RUN, after["wandb"]["id"])}
    assert len(sessions) == 3  # further offline sessions of the same W&B run
    assert _wandb_children() == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the "kill"
def test_a_kill_while_another_tracker_starts_resumes_the_same_mlflow_run(tmp_path, monkeypatch):
    """The process dies while W&B starts (its offline service takes seconds), after MLflow made its run:
    the resume continues that run, with its params, instead of making a second one (seen in CI)."""
    _write_store(tmp_path)
    cfg = _cfg(tmp_path, "mlflow", "wandb")

    class DiesStarting(WandbTracker):
        def open(self, state):
            raise SystemExit  # as a kill: nothing after this line of the tracking thread runs

    monkeypatch.setitem(TRACKERS, "wandb", DiesStarting)
    first = tracking(cfg, RUN, flow_run_id="flow-a", logger=ListLogger())
    first._thread.join(30)
    made = _state(tmp_path)["mlflow"]["run_id"]
    monkeypatch.setitem(TRACKERS, "wandb", WandbTracker)
    second = tracking(cfg, RUN, flow_run_id="flow-b", logger=ListLogger())
    second.closed(STEPS - 1)
    second.finish(None)
    client = _mlflow(tmp_path)
    (exp,) = [e for e in client.search_experiments() if e.name == "grpoflow"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == made == _state(tmp_path)["mlflow"]["run_id"]
    assert run.data.params == config_params(cfg) | {"run.run_id": RUN}
    assert run.data.tags["grpoflow.flow_run_id"] == "flow-b"
    assert "setup" not in _state(tmp_path)["mlflow"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the "kill"
def test_a_resume_that_completes_an_interrupted_mlflow_setup_logs_the_same_params(tmp_path, monkeypatch):
    """Killed after MLflow took the first launch's params (`--run-id`: run.run_id set) but before its
    setup was recorded whole; the --resume (run.run_id unset) logs them again: the same values, or
    MLflow refuses the batch and the tracker is dropped for the run (seen in CI)."""
    _write_store(tmp_path)

    class DiesTagging(MlflowTracker):
        def set_tags(self, tags):
            raise SystemExit  # as a kill between the params and the record that setup is done

    monkeypatch.setitem(TRACKERS, "mlflow", DiesTagging)
    first = tracking(
        _cfg(tmp_path, "mlflow", **{"run.run_id": RUN}), RUN, flow_run_id="flow-a", logger=ListLogger()
    )
    first._thread.join(30)
    assert _state(tmp_path)["mlflow"]["setup"] is False
    monkeypatch.setitem(TRACKERS, "mlflow", MlflowTracker)
    log = ListLogger()
    resumed = _cfg(tmp_path, "mlflow")
    assert resumed.run.run_id is None
    second = tracking(resumed, RUN, flow_run_id="flow-b", logger=log)
    second.closed(STEPS - 1)
    second.finish(None)
    assert log.warnings == []
    run = _mlflow(tmp_path).get_run(_state(tmp_path)["mlflow"]["run_id"])
    assert run.data.params["run.run_id"] == RUN and "setup" not in _state(tmp_path)["mlflow"]


def test_tensorboard_relog_after_a_kill_shows_only_the_new_values(tmp_path):
    """A killed process logged steps 3..4 but its state still says 2 (killed before recording its last
    flush); the resumed run redid 3..4 with other values: readers see those, once each."""
    _write_store(tmp_path, range(5))
    cfg = _cfg(tmp_path, "tensorboard")
    killed = tracking(cfg, RUN, logger=ListLogger())
    killed.closed(4)
    killed.finish(None)
    state = _state(tmp_path)
    state["tensorboard"]["cursor"] = 2
    (tmp_path / "tracking" / f"{RUN}.json").write_text(json.dumps(state))
    RolloutStore(tmp_path).delete_steps_after(RUN, 2)  # as the resume does, then redoes 3..5
    _write_store(tmp_path, range(3, STEPS), shift=10.0)
    resumed = tracking(cfg, RUN, logger=ListLogger())
    resumed.closed(STEPS - 1)
    resumed.finish(None)

    expected = _expected(tmp_path)
    assert expected[3]["reward/mean"] == 1.0 + 10.0  # the new values
    assert _tb_scalars(_tb(tmp_path)) == _by_key(expected, as_float32=True)


# A process that reports to the trackers its overrides name, closes steps 0..2, and waits to be killed.
_KILLED = f"""
import sys, time
from grpoflow.flows.config import load_config
from grpoflow.flows.viewing.tracking import tracking

tracking(load_config(None, sys.argv[1:]), {RUN!r}).closed(2)
time.sleep(600)
"""


def _flushed_through(root: Path, tracker: str) -> int:
    path = root / "tracking" / f"{RUN}.json"
    return json.loads(path.read_text()).get(tracker, {}).get("cursor", -1) if path.is_file() else -1


def test_a_wandb_session_killed_before_its_run_finished_loses_no_step(tmp_path):
    """SIGKILLed once steps 0..2 went to W&B and were flushed (TensorBoard's cursor, saved in the same
    round, says 2), before W&B's run finished: W&B had not written them (it writes a session's log at
    `finish`), its cursor never moved, and the resume logs 0..5 to W&B, each once."""
    _write_store(tmp_path)
    trackers = ("tensorboard", "wandb")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, *_overrides(tmp_path, *trackers)])
    try:
        deadline = time.monotonic() + 120
        while _flushed_through(tmp_path, "tensorboard") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the process never flushed step 2"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert _state(tmp_path)["wandb"]["cursor"] == -1
    log = ListLogger()
    resumed = tracking(_cfg(tmp_path, *trackers), RUN, logger=log)
    resumed.closed(STEPS - 1)
    resumed.finish(None)
    assert log.warnings == []
    assert _wandb_logged(tmp_path) == _expected(tmp_path)  # every step, none twice
    assert _state(tmp_path)["wandb"]["cursor"] == STEPS - 1


# -- failures ----------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failing_tracker_is_warned_about_once_and_the_others_go_on(tmp_path, monkeypatch):
    _write_store(tmp_path)
    dead = f"http://127.0.0.1:{_closed_port()}"
    cfg = _cfg(tmp_path, "mlflow", "tensorboard", **{"tracking.mlflow_tracking_uri": dead})
    log = ListLogger()
    # MLflow's first call is held until every step is closed: `closed` must return while a tracker is
    # busy (the training loop never waits on one), and the call is made on the tracking thread.
    release, held = threading.Event(), []
    real_open = MlflowTracker.open

    def held_open(self, state):
        held.append((threading.current_thread().name, release.wait(60)))  # 60 s: a hang fails the test
        return real_open(self, state)

    monkeypatch.setattr(MlflowTracker, "open", held_open)
    t = tracking(cfg, RUN, logger=log)
    for step in range(STEPS):
        t.closed(step)
    release.set()
    t.finish(None)
    assert held == [(f"tracking-{RUN}", True)]  # released by the test, not by the timeout
    (warning,) = log.warnings
    assert warning.startswith("tracking: mlflow failed and is dropped") and "MlflowException" in warning
    assert "mlflow" not in t.links() and set(_state(tmp_path)) == {"tensorboard"}
    assert _tb_scalars(_tb(tmp_path)) == _by_key(_expected(tmp_path), as_float32=True)


def test_metric_and_param_names_mlflow_refuses_are_mapped_and_others_kept():
    assert _mlflow_key("reward/mean") == "reward/mean" and _mlflow_key("gen/server0/up") == "gen/server0/up"
    assert _mlflow_key("reward/exact+1/failed_rate") == "reward/exact_1/failed_rate"
    assert _mlflow_key("reward//x") == "reward__x"


def test_check_trackers_names_the_field_and_the_extra(tmp_path, monkeypatch):
    import importlib.util

    cfg = _cfg(tmp_path, "tensorboard", "mlflow")
    check_trackers(cfg)  # all installed here
    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "mlflow" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(ConfigError) as e:
        check_trackers(cfg)
    assert str(e.value) == (
        "run.report_to[1]: mlflow is not installed: pip install 'grpoflow[mlflow]' (or grpoflow[tracking] "
        "for all three; make install installs them)"
    )


def test_the_trackers_are_the_configs_choices():
    assert tuple(TRACKERS) == TRACKER_NAMES
    assert {name: (t.title, t.module) for name, t in TRACKERS.items()} == {
        "tensorboard": ("TensorBoard", "tensorboard"), "mlflow": ("MLflow", "mlflow"), "wandb": ("W&B", "wandb")}  # fmt: skip


def test_no_tracking_without_report_to_and_no_tracker_imported_until_then(tmp_path):
    assert tracking(_cfg(tmp_path), RUN) is None
    code = (
        "import sys, grpoflow.flows.viewing.tracking; "
        "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
