"""prefect.yaml as shipped: `prefect server start`, `prefect deploy --all`, a process worker, and
deployment runs triggered through the API (the way users run grpoflow from the UI)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.flows.processes.launch import free_port, is_healthy
from grpoflow.storage.records import RolloutCompletion, RolloutGroup
from grpoflow.storage.rollouts import RolloutStore
from tests.support import need_browser, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture
def prefect_server(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_API_URL=api, PREFECT_HOME=str(tmp_path / "prefect-home"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")  # fmt: skip
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed in the finalizer
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    procs = [server]
    try:

        def up() -> bool:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            return is_healthy(api)

        wait_for(up, 180, "Prefect's server", 0.5, why=lambda: (tmp_path / "server.log").read_text()[-2000:])
        yield api, env, procs
    finally:
        _stop(procs)
        log.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to the server and its workers at once, SIGKILL to what is left of them and their children
    10 s later: a worker's graceful shutdown took the whole 30 s it was given, each in turn (60 s of the
    suite's time)."""
    import psutil

    tree = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [(parent := psutil.Process(p.pid)), *parent.children(recursive=True)]
    for p in reversed(procs):
        p.terminate()
    _, left = psutil.wait_procs(tree, timeout=10)
    for q in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.kill()
    for p in procs:
        p.wait()


def _cli(args: list[str], env: dict) -> str:
    out = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_deploy_all_then_run_deployments_through_the_api(
    prefect_server, tmp_path, vllm_server, tiny_model_dir
):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env, procs = prefect_server
    # The worker's own settings (never a flow parameter): what runs it starts may read and contact.
    env = {**env, "GRPOFLOW_ALLOWED_ROOTS": os.pathsep.join(map(str, [REPO, tmp_path, tiny_model_dir.parent])),
           "GRPOFLOW_ALLOWED_SERVERS": vllm_server.url}  # fmt: skip
    _cli(["work-pool", "create", "cpu", "--type", "process", "--overwrite"], env)
    _cli(["work-pool", "create", "gpu", "--type", "process", "--overwrite"], env)
    _cli(["--no-prompt", "deploy", "--all"], env)
    with open(tmp_path / "worker.log", "w") as wlog:
        procs.append(subprocess.Popen([PREFECT, "worker", "start", "--pool", "cpu"], cwd=REPO, env=env,
                                      stdout=wlog, stderr=subprocess.STDOUT))  # fmt: skip

    store = tmp_path / "store"
    comps = [RolloutCompletion(i, "a" * i, [1] * i, [1] * i, [-1.0] * i, reward=i / 4, reward_valid=True)
             for i in range(1, 5)]  # fmt: skip
    RolloutStore(store).write_rollouts("r", 0, [RolloutGroup("g", 0, "p", [0], comps)])
    config = {"model": {"path": str(tiny_model_dir)}, "inference": {"url": vllm_server.url},
              "storage": {"root": str(store)}, "generation": {"group_size": 2, "max_tokens": 4}}  # fmt: skip

    with temporary_settings(updates={PREFECT_API_URL: api}):
        sql_run = run_deployment("rollout-sql/rollout-sql", parameters={"root": str(store)}, timeout=600)
        # On the shared server (its base weights, loaded again): an evaluation on a server of its own,
        # started inside a worker's flow run, is test_hosts_ray's retrain gate; a training's embedded
        # server in a worker is cancel_from_the_ui's (below).
        eval_run = run_deployment("grpo-evaluate/grpo-evaluate", timeout=600,
                                  parameters={"config": config, "prompts": 2, "server_url": vllm_server.url})  # fmt: skip
        with get_client(sync_client=True) as client:
            assert sql_run.state.is_completed(), (tmp_path / "worker.log").read_text()[-3000:]
            assert eval_run.state.is_completed(), (tmp_path / "worker.log").read_text()[-3000:]
            keys = {a.key for a in client.read_artifacts()}
            assert "rollout-sql" in keys and "base-eval-0" in keys
            retrain = client.read_deployment_by_name("grpo-retrain/grpo-retrain")
            assert [s.schedule.cron for s in retrain.schedules] == ["0 3 * * *"]
            automations = client.read_automations_by_name("grpo-retrain-on-dataset-updated")
            assert automations and "dataset.updated" in automations[0].trigger.expect
            # prefect 3.8 moves a deployment's concurrency_limit into a global concurrency limit object
            assert retrain.global_concurrency_limit.limit == 1
            assert retrain.concurrency_options.collision_strategy == "CANCEL_NEW"
            train = client.read_deployment_by_name("grpo-train/grpo-train")
            schema = train.parameter_openapi_schema
            assert "config" in schema["properties"]
            defs = schema.get("definitions") or schema.get("$defs")
            assert defs["GenerationConfig"]["properties"]["group_size"]["description"]
    # the evaluation wrote its rollouts with split='eval'
    assert RolloutStore(store).steps_written("rollouts", "base-eval") == [0]
    explorer_from_a_worker(api, tmp_path, store)
    cancel_from_the_ui(api, env, procs, tmp_path, tiny_model_dir, vllm_server)
    shell_as_a_tool_is_refused(api, tmp_path, tiny_model_dir)

    # The UI: headless Chromium renders grpo-train's run form, built from the pydantic config schema.
    ui = api.removesuffix("/api")
    dom = chromium(f"{ui}/deployments/deployment/{train.id}/run", tmp_path / "grpo-train-form.png")
    assert "grpo-train" in dom
    assert "Completions per prompt (G)" in dom  # GenerationConfig.group_size's description


def explorer_from_a_worker(api, tmp_path, store) -> None:
    """The rollout-explorer deployment serves the store's runs from the cpu worker on loopback until its
    flow run is cancelled; then the port is closed."""
    import urllib.request

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    port = free_port()

    def runs():
        try:
            with urllib.request.urlopen(f"http://localhost:{port}/api/runs", timeout=5) as resp:
                return sorted(r["run_id"] for r in json.load(resp)["runs"])
        except OSError:
            return None

    worker_log = lambda: (tmp_path / "worker.log").read_text()[-3000:]  # noqa: E731
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        run = run_deployment("rollout-explorer/rollout-explorer", parameters={"root": str(store), "port": port},
                             timeout=0)  # fmt: skip
        assert wait_for(runs, 120, "the explorer deployment to serve", 0.5, why=worker_log) == [
            "base-eval",
            "r",
        ]
        client.set_flow_run_state(run.id, Cancelling(), force=True)
        wait_for(
            lambda: client.read_flow_run(run.id).state.is_cancelled(), 120, "the cancel", 1, why=worker_log
        )
    wait_for(lambda: runs() is None, 30, "the explorer's port to close")


def cancel_from_the_ui(api, env, procs, tmp_path, tiny_model_dir, vllm_server) -> None:
    """A grpo-train run with its own embedded vLLM server, cancelled through the API as the UI's
    Cancel button does: the worker stops the flow, the server goes with it, the run reads `cancelled`,
    and `grpoflow train --resume` continues it."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    from grpoflow.storage.processes import alive, group_members, kill_tree
    from grpoflow.storage.sql import run_status

    with open(tmp_path / "gpu-worker.log", "w") as wlog:
        procs.append(subprocess.Popen([PREFECT, "worker", "start", "--pool", "gpu"], cwd=REPO, env=env,
                                      stdout=wlog, stderr=subprocess.STDOUT))  # fmt: skip
    store = tmp_path / "cancel-store"
    config = {"model": {"path": str(tiny_model_dir)}, "storage": {"root": str(store)},
              "run": {"run_id": "cancelme", "steps": 500}}  # fmt: skip
    pid_file = store / "pids" / "vllm-cancelme.json"
    server: list[int] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            run = run_deployment("grpo-train/grpo-train", parameters={"config": config}, timeout=0)
            worker_log = lambda: (tmp_path / "gpu-worker.log").read_text()[-3000:]  # noqa: E731
            wait_for(
                lambda: pid_file.is_file() and len(group_members(json.loads(pid_file.read_text())["pid"])) >= 2,
                300, "the run's embedded server and its engine", 0.5, why=worker_log,
            )  # fmt: skip
            server = group_members(json.loads(pid_file.read_text())["pid"])
            client.set_flow_run_state(run.id, Cancelling(), force=True)
            wait_for(
                lambda: client.read_flow_run(run.id).state.is_cancelled(),
                180,
                "the cancel",
                1,
                why=worker_log,
            )
        wait_for(lambda: not any(alive(p) for p in server), 30, "the embedded server to die with the cancel")
    finally:
        kill_tree(server)
    assert run_status(json.loads((store / "runs" / "cancelme.json").read_text())) == "cancelled"
    resume = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--resume", "cancelme", "--set", f"storage.root={store}",
              "--set", f"model.path={tiny_model_dir}", "--set", f"inference.url={vllm_server.url}",
              "--set", "run.steps=2"]  # fmt: skip
    out = subprocess.run(resume, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert run_status(json.loads((store / "runs" / "cancelme.json").read_text())) == "completed"


def shell_as_a_tool_is_refused(api, tmp_path, tiny_model_dir) -> None:
    """A UI user sets `os:system` as a tool: the worker-started run fails at preflight, naming the
    field and the worker's allow-list, before any model is loaded or file written."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    store = tmp_path / "refused-store"
    config = {"model": {"path": str(tiny_model_dir)}, "storage": {"root": str(store)},
              "tools": {"tools": ["os:system"]}, "generation": {"max_turns": 2}}  # fmt: skip
    with temporary_settings(updates={PREFECT_API_URL: api}):
        run = run_deployment("grpo-train/grpo-train", parameters={"config": config}, timeout=600)
    assert run.state.is_failed()
    assert "tools.tools[0]: refused" in run.state.message and "GRPOFLOW_ALLOWED_MODULES" in run.state.message
    assert not store.exists()


def chromium(url: str, screenshot: Path) -> str:
    """Headless Debian Chromium: the page's DOM after its scripts ran, plus a screenshot."""
    need_browser("chromium")
    binary = shutil.which("chromium")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={screenshot.parent / 'chromium-profile'}", "--virtual-time-budget=20000",
             "--window-size=1280,2400"]  # fmt: skip
    subprocess.run([binary, *flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    assert screenshot.stat().st_size > 10_000
    out = subprocess.run([binary, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return out.stdout
