"""Server faults with real processes: SIGKILL the vLLM server mid-request under `grpoflow serve`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.serve import free_port
from tasks.inference import InferenceUnavailableError, VLLMClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for(pred, timeout: float, what: str, proc=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: supervisor exited with {proc.returncode}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def server_pid(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"api_server.*--port {port}"], capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_killed_server_fails_requests_clearly_and_the_supervisor_restarts_it(
    tiny_model_dir, tmp_path, prefect_api
):
    from prefect.settings import PREFECT_API_URL

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()))
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--model", str(tiny_model_dir),
                                 "--port", str(port)], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: healthy(url), 400, "first start", proc)
        first = server_pid(port)

        async def in_flight_then_kill():
            async with VLLMClient(url, retries=2, backoff_s=0.2) as c:
                req = asyncio.create_task(c.complete([5] * 16, max_tokens=1000, temperature=1.0, seed=1))
                await asyncio.sleep(0.3)
                os.killpg(first, signal.SIGKILL)
                t0 = time.perf_counter()
                with pytest.raises(InferenceUnavailableError, match="after 3 attempts"):
                    await req
                return time.perf_counter() - t0

        assert asyncio.run(in_flight_then_kill()) < 10  # bounded retries, then a clear error
        wait_for(lambda: healthy(url), 400, "restart by the policy-server flow", proc)
        assert server_pid(port) != first

        async def works():
            async with VLLMClient(url) as c:
                return await c.complete([5] * 8, max_tokens=4, temperature=0.0)

        assert len(asyncio.run(works())[0].token_ids) >= 1
        assert "restart 1/3" in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        subprocess.run(["pkill", "-9", "-f", f"api_server.*--port {port}"])
    assert not healthy(url)
