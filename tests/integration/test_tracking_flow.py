"""Trackers and eval during training on the real vLLM server, through the CLI.

One run reports to TensorBoard, MLflow (a real `mlflow server` process) and W&B (offline) and scores
its held-out split every 2 steps. It is SIGKILLed mid-run, resumed, and its MLflow server is killed
while the resumed run trains: the run completes, every Parquet row is there once, the failure is said
once. A `--resume` of the finished run, with MLflow back, catches MLflow up. Then each tracker's own
reader (TensorBoard's event accumulator, MlflowClient, W&B's offline run files) holds exactly the
`steps` table: every step once, the same values.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import CANNED, query
from tests.support import REPO, wait_for

pytestmark = pytest.mark.integration

STEPS, PROMPTS, G, EVAL_ROWS = 6, 2, 4, 3
RUN = "tracked"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlflow_server(tmp_path: Path, port: int) -> subprocess.Popen:
    """A real MLflow tracking server on loopback, its runs in SQLite and its artifacts in a folder."""
    (tmp_path / "mlflow-server").mkdir(exist_ok=True)
    with open(tmp_path / "mlflow-server.log", "ab") as log:
        proc = _spawn_mlflow(tmp_path, port, log)

    def up() -> bool:
        import urllib.error
        import urllib.request

        # An API call, not /health: the server opens its tracking store (the SQLite schema check) on the
        # first request that needs it, and on a loaded machine that first request outlasted the MLflow
        # tracker's 5 s request timeout and retry, so the tracker was dropped for the whole run.
        api = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
        try:
            with urllib.request.urlopen(api, timeout=60) as r:
                return r.status == 200
        except urllib.error.HTTPError as e:
            return e.code == 404  # answered from the store: no such experiment
        except OSError:
            assert proc.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            return False

    wait_for(
        up, 180, "the MLflow server", 0.5, why=lambda: (tmp_path / "mlflow-server.log").read_text()[-3000:]
    )
    return proc


def _spawn_mlflow(tmp_path: Path, port: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow-server' / 'mlflow.db'}",
         "--artifacts-destination", str(tmp_path / "mlflow-server" / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
    )  # fmt: skip


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _table(root: Path) -> dict[int, dict[str, float]]:
    """The steps table: step -> every metric it holds (NULLs left out), as trackers must show it."""
    rows = RolloutStore(root).read_steps(RUN)
    out = {}
    for r in rows:
        out[r["step"]] = {
            k: float(v) for k, v in r.items()
            if k not in ("run_id", "step", "created_at") and v is not None and math.isfinite(v)
        }  # fmt: skip
    return out


def _same(logged: dict[int, dict[str, float]], table: dict[int, dict[str, float]], who: str) -> None:
    assert sorted(logged) == sorted(table), f"{who}: steps {sorted(logged)} != {sorted(table)}"
    for step, metrics in table.items():
        for k, v in metrics.items():
            assert k in logged[step], f"{who}: step {step} lacks {k}"
            assert logged[step][k] == pytest.approx(v, rel=1e-6, abs=1e-6), f"{who}: step {step} {k}"


@pytest.mark.slow
def test_trackers_hold_the_steps_table_through_a_kill_and_a_dead_mlflow_server(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    from prefect.settings import PREFECT_API_URL

    port = _free_port()
    mlflow = _mlflow_server(tmp_path, port)
    uri = f"http://127.0.0.1:{port}"
    sets = [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
            f"run.steps={STEPS}", "run.checkpoint_every=2", "run.eval_every=2", f"run.eval_prompts={EVAL_ROWS}",
            "data.eval_fraction=0.25", f"data.prompts_per_step={PROMPTS}", f"generation.group_size={G}",
            "run.report_to=[tensorboard, mlflow, wandb]", f"tracking.mlflow_tracking_uri={uri}",
            "run.log_samples_every=2", "algorithm.max_staleness=0"]  # fmt: skip
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()),
           **{f"WANDB_{d}_DIR": str(tmp_path / f"wandb-{d.lower()}") for d in ("DATA", "CACHE", "CONFIG")}}  # fmt: skip

    def train(*args: str, faults: str = "") -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "grpoflow.flows.cli.main", "train", *args, *[a for s in sets for a in ("--set", s)]],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "GRPOFLOW_FAULTS": faults} if faults else env,
        )  # fmt: skip

    try:
        # 1. Killed in step 3's update: steps 0-1 are closed (checkpoint after step 1), step 2's rows
        #    are written and will be redone.
        killed = train("--run-id", RUN, faults="train@4:kill")
        _, err = killed.communicate(timeout=600)
        assert killed.returncode == -signal.SIGKILL, err[-3000:]
        assert 2 in RolloutStore(tmp_path).steps_written("steps", RUN)

        # 2. Resumed, held before step 4's update (the resumed process's 3rd train step: steps 2, 3, 4)
        #    until the test says go; once step 3 is written (its checkpoint closes it and MLflow gets
        #    it), the MLflow server dies, then the run goes on: steps 4-5 cannot reach it.
        go = tmp_path / "go"
        resumed = train("--resume", RUN, faults=f"train@3:wait={go}")
        wait_for(lambda: 3 in RolloutStore(tmp_path).steps_written("steps", RUN) or resumed.poll() is not None,
                 600, "step 3 of the resumed run", 0.2)  # fmt: skip
        _kill(mlflow)
        go.touch()
        _, err = resumed.communicate(timeout=600)
        assert resumed.returncode == 0, err[-3000:]
        said = [line for line in err.splitlines() if "mlflow" in line.lower() and "tracker" in line.lower()]
        assert len(said) == 1, err[-3000:]  # said once, then MLflow is left out for the rest of the run

        # Every table holds each step exactly once; the eval rows sit at steps 1, 3, 5.
        _, rows = query(tmp_path, "SELECT split, step, count(*) FROM rollouts WHERE run_id = $r "
                                  "GROUP BY ALL ORDER BY split, step", {"r": RUN})  # fmt: skip
        assert rows == [("eval", s, EVAL_ROWS * G) for s in (1, 3, 5)] + [
            ("train", s, PROMPTS * G) for s in range(STEPS)
        ]
        _, rows = query(tmp_path, "SELECT step, count(*) FROM rewards WHERE run_id = $r GROUP BY step "
                                  "ORDER BY step", {"r": RUN})  # fmt: skip
        assert rows == [(s, PROMPTS * G + (EVAL_ROWS * G if s % 2 else 0)) for s in range(STEPS)]
        # The same held-out rows every time, never trained on.
        _, held = query(tmp_path, "SELECT step, list(DISTINCT row_id ORDER BY row_id) FROM rollouts "
                                  "WHERE run_id = $r AND split = 'eval' GROUP BY step ORDER BY step", {"r": RUN})  # fmt: skip
        assert len({tuple(ids) for _, ids in held}) == 1 and len(held[0][1]) == EVAL_ROWS
        _, overlap = query(tmp_path, "SELECT count(*) FROM rollouts t JOIN rollouts e USING (row_id) "
                                     "WHERE t.split = 'train' AND e.split = 'eval'")  # fmt: skip
        assert overlap == [(0,)]

        table = _table(tmp_path)
        # eval/ metrics are the eval rows' own figures, at the eval steps only
        _, curve = query(tmp_path, "SELECT step, reward_mean FROM (" + CANNED["eval_curve"] + ") ORDER BY step",
                         {"run": RUN})  # fmt: skip
        for step, mean in curve:
            if mean is not None:
                assert table[step]["eval/reward/mean"] == pytest.approx(mean)
            assert table[step]["eval_seconds"] > 0
        assert not any("eval/reward/mean" in table[s] for s in (0, 2, 4))

        # 3. MLflow back (same store); a --resume of the finished run catches it up.
        mlflow = _mlflow_server(tmp_path, port)
        again = train("--resume", RUN)
        _, err = again.communicate(timeout=600)
        assert again.returncode == 0, err[-3000:]
        # A tracker dropped or not waited for here would show below only as a tracking run short of steps.
        said = [line for line in err.splitlines() if any(
            w in line for w in ("is dropped for the rest", "gave up waiting for the trackers", "tracking of run"))]  # fmt: skip
        assert said == [], err[-3000:]
        assert _table(tmp_path) == table  # nothing retrained

        # TensorBoard: its own event reader, after the resume purged what the kill left unclosed.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(
            str(tmp_path / "tensorboard" / RUN), size_guidance={"scalars": 0, "tensors": 0}
        )
        acc.Reload()
        tb: dict[int, dict[str, float]] = {}
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            assert len({e.step for e in events}) == len(events), f"tensorboard: {tag} logged twice at a step"
            for e in events:
                tb.setdefault(e.step, {})[tag] = e.value
        _same(tb, table, "tensorboard")

        # MLflow: the one tracking run, its metric histories.
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        runs = client.search_runs(
            [client.get_experiment_by_name("grpoflow").experiment_id], f"tags.`grpoflow.run_id` = '{RUN}'"
        )
        assert len(runs) == 1
        ml: dict[int, dict[str, float]] = {}
        for key in runs[0].data.metrics:
            history = client.get_metric_history(runs[0].info.run_id, key)
            assert len({m.step for m in history}) == len(history), f"mlflow: {key} logged twice at a step"
            for m in history:
                ml.setdefault(m.step, {})[key] = m.value
        _same(ml, table, "mlflow")
        assert runs[0].data.params["run.steps"] == str(STEPS)

        # W&B: the offline run files, read by the tests' reader of W&B's transaction logs.
        from tests.support_wandb import wandb_history

        wb = wandb_history(tmp_path / "wandb" / RUN)
        _same({s: {k: v for k, v in m.items() if k in table[s]} for s, m in wb.items()}, table, "wandb")

        # The run's summary artifact in Prefect links each tracking run.
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            summaries = sorted((a for a in client.read_artifacts() if a.key == f"{RUN}-summary"),
                               key=lambda a: a.created)  # fmt: skip
        summary = summaries[-1].data
        mlflow_run = f"{uri}/#/experiments/{runs[0].info.experiment_id}/runs/{runs[0].info.run_id}"
        assert f"[{mlflow_run}]({mlflow_run})" in summary, summary
        assert f"`{tmp_path / 'tensorboard' / RUN}`" in summary and f"`{tmp_path / 'wandb' / RUN}" in summary
    finally:
        if mlflow.poll() is None:
            _kill(mlflow)
