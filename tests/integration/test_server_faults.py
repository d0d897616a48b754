"""Server faults with real processes: SIGKILL the vLLM server mid-request under `grpoflow serve` (run with
an API key, which must guard every endpoint but /health)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from grpoflow.flows.processes.launch import free_port, is_healthy
from grpoflow.storage.processes import group_members, kill_tree
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from tests.support import REPO, until_running, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.memory_heavy]


def healthy_while_running(url: str, proc: subprocess.Popen):
    """A condition for wait_for: the server at `url` answers; fails at once if `proc` (the supervisor)
    exited."""

    def check() -> bool:
        assert proc.poll() is None, f"the supervisor exited with {proc.returncode}"
        return is_healthy(url)

    return check


def server_pid_or_none(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"api_server.*--port {port}"], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out.split() else -1


def server_tmp(pid: int) -> str:
    """The folder the server process `pid` puts its IPC sockets in (its own: flows/processes/serve.py)."""
    return psutil.Process(pid).environ()["VLLM_RPC_BASE_PATH"]


def server_pid(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"api_server.*--port {port}"], capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_killed_server_fails_requests_clearly_and_the_supervisor_restarts_it(
    tiny_model_dir, tmp_path, prefect_api
):
    from prefect.settings import PREFECT_API_URL

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key = "grpoflow-test-key"
    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()), GRPOFLOW_API_KEY=key)
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "grpoflow.flows.cli.main", "serve", "--model", str(tiny_model_dir),
                                 "--port", str(port)], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(healthy_while_running(url, proc), 400, "the server's first start", interval_s=0.5)
        first = server_pid(port)
        # vLLM's IPC sockets go to the server's own folder, not the system's temporary folder
        first_tmp = server_tmp(first)
        assert "grpoflow-vllm-" in first_tmp and any(p.is_socket() for p in Path(first_tmp).iterdir())
        # With a key, every endpoint but /health needs it, the control ones (weight reload) included,
        # and the key never appears on a command line.
        for method, path in [("POST", "/v1/completions"), ("POST", "/pause"), ("POST", "/collective_rpc")]:
            req = urllib.request.Request(url + path, data=b"{}", method=method)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401, path
        ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout  # full width
        assert "api_server" in ps and key not in ps

        async def in_flight_then_kill():
            async with VLLMClient(url, api_key=key, retries=2, backoff_s=0.2) as c:
                # ignore_eos: the request must still run at the kill, whatever it samples (an EOS ended it early)
                req = asyncio.create_task(
                    c.complete([5] * 16, max_tokens=1000, temperature=1.0, seed=1, ignore_eos=True)
                )
                await until_running(url, api_key=key)  # the server says it generates it: killed mid-request
                os.killpg(first, signal.SIGKILL)
                with pytest.raises(InferenceUnavailableError, match="after 3 attempts") as e:
                    await req
                return str(e.value)

        # bounded retries, then a clear error: each attempt refused by the dead server, none timed out
        error = asyncio.run(in_flight_then_kill())
        assert "TimeoutError" not in error, error
        wait_for(healthy_while_running(url, proc), 400, "restart by the policy-server flow", interval_s=0.5)
        second = server_pid(port)  # the guarded API server leads its group: engine and workers too
        assert second != first
        # the killed server's folder went at its restart; the new one has its own
        second_tmp = server_tmp(second)
        assert not Path(first_tmp).exists() and Path(second_tmp).is_dir() and second_tmp != first_tmp

        async def works():
            async with VLLMClient(url, api_key=key) as c:
                await c.pause(mode="keep", clear_cache=False)  # the client sends the key everywhere
                await c.resume()
                return await c.complete([5] * 8, max_tokens=4, temperature=0.0)

        assert len(asyncio.run(works())[0].token_ids) >= 1
        assert "restart 1/3" in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C on `grpoflow serve`
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        group = second if "second" in locals() else server_pid_or_none(port)
        if group > 0:  # a group being killed right now gets a moment; what is left is asserted below
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not group_members(group), 10, "the server's group to go")
        left = group_members(group) if group > 0 else []
        if group > 0:
            kill_tree([group])
    assert not is_healthy(url)
    # Nothing of the server outlives it: not the API server, nor its engine and worker processes, nor
    # its temporary folder.
    assert left == [], f"server processes left behind: {left}"
    assert not Path(second_tmp).exists()


def test_train_flow_survives_a_killed_embedded_server(tiny_model_dir, tmp_path, prefect_api):
    """SIGKILL the run's own vLLM server mid-run: it is restarted, gets the current weights back, and
    every step lands exactly once. A bf16 run: both servers serve bfloat16 where this CPU computes it
    natively (flows/processes/vllm_command.py: served_dtype), float32 elsewhere, and take the bf16 pushes."""
    import re
    import shutil
    import threading

    from grpoflow.flows.config import load_config
    from grpoflow.flows.processes.vllm_command import served_dtype
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.rollouts import RolloutStore

    model = tmp_path / "embedded-model"  # a unique path, so pgrep finds only this run's server
    shutil.copytree(tiny_model_dir, model)
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", [
        f"storage.root={tmp_path}", f"model.path={model}", "run.steps=8", "run.run_id=phoenix",
        "algorithm.max_staleness=1", "inference.retries=2", "model.dtype=bfloat16",
    ])  # fmt: skip
    store = RolloutStore(tmp_path)
    killed = []

    def killer():
        with contextlib.suppress(AssertionError):  # not within 600 s: nothing killed, the test fails
            wait_for(lambda: len(store.steps_written("steps", "phoenix")) >= 3, 600, "step 2 stored")
        out = subprocess.run(["pgrep", "-f", f"api_server --model {model}"], capture_output=True, text=True)
        for pid in out.stdout.split():
            os.killpg(int(pid), signal.SIGKILL)
            killed.append(int(pid))

    t = threading.Thread(target=killer)
    t.start()
    try:
        summary = grpo_train(config=cfg)
    finally:
        t.join()
    assert killed and summary["steps_trained"] == 8
    for table in ("rollouts", "rewards", "steps"):
        assert store.steps_written(table, "phoenix") == list(range(8))
    restarts = [s["server_restarts"] for s in store.read_steps("phoenix")]
    assert restarts[-1] >= 1 and restarts[0] == 0
    # each start's engine config, as vLLM logs it: the first server and its restart alike
    served = re.findall(r"\bdtype=torch\.(\w+)", (tmp_path / "logs" / "vllm-phoenix.log").read_text())
    assert len(served) >= 2 and set(served) == {served_dtype(cfg)}, served
