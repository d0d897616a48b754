"""A run across three hosts (issue 47; tests/hosts.py: network namespaces on a bridge): the learner's
host runs `grpoflow train` (its own Prefect API) and a Ray head with no CPUs of its own; a Ray worker
host (`ray start --address`, one CPU) scores the rewards (`executor: ray`); a `grpoflow serve` server
on a third host, in a mount namespace where the learner's store is an empty tmpfs, generates and gets
every push over the network. Where each thing ran is read from the store alone: every reward cell
names the worker host's Ray node, every completion the third host's server, every push the network. Then the third host joins the Ray cluster too, and a sharded learner of two
ranks, one on each of the two hosts with CPUs (gloo over the bridge), makes the single process's update.
The Ray head, its worker and the server stay up for the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpoflow.flows.launch import is_healthy
from grpoflow.storage.sql import query
from tests.hosts import Host
from tests.integration.test_distributed import WEIGHT_ATOL
from tests.support import REPO, hosts_fixture, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
KEY, SERVE_PORT, RAY_PORT, STEPS = "hosts-ray-key", 8766, 6379, 2
RAY = str(Path(sys.executable).with_name("ray"))

three_hosts = hosts_fixture(3, prefix="gr", scope="module")
_TEMPS: list[Path] = []  # the Ray nodes' temp folders


@pytest.fixture(scope="module", autouse=True)
def _remove_temps():
    yield
    for t in _TEMPS:
        shutil.rmtree(t, ignore_errors=True)


CONFIG = """
model: {path: MODEL}
data: {generator: "grpoflow.examples.envs:letters_rows", generator_kwargs: {n: 16}, prompts_per_step: 4}
generation: {group_size: 4, max_tokens: 8}
rewards:
  - {name: letter, fn: "grpoflow.examples.rewards:letter_fraction", kwargs: {target_letter: a}, executor: ray}
algorithm: {max_staleness: 0}
run: {steps: STEPS}
"""


def _start_ray(host: Host, tmp: Path, *args: str) -> subprocess.Popen:
    """`ray start --block` on `host`, its sessions and sockets in a short temp folder of its own (a
    socket path has at most 107 bytes), removed with the module's hosts."""
    temp = Path(tempfile.mkdtemp(prefix=f"{host.name}-", dir="/tmp"))
    _TEMPS.append(temp)
    log = open(tmp / f"ray-{host.name}.log", "ab")  # noqa: SIM115 (the process keeps its own descriptor)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = ["--include-dashboard=false", "--disable-usage-stats"] if "--head" in args else []
    cmd = [RAY, "start", "--block", f"--node-ip-address={host.address}", f"--temp-dir={temp}",
           "--object-store-memory=100000000", *head, *args]  # fmt: skip
    with log:
        return host.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _up(host: Host, port: int, proc: subprocess.Popen, what: str) -> bool:
    assert proc.poll() is None, f"{what} exited ({proc.returncode})"
    return host.answers(port)


def _healthy(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"grpoflow serve exited ({proc.returncode})"
    return is_healthy(url)  # /health needs no key


def _log(tmp: Path, name: str) -> str:
    path = tmp / name
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {name})"


@pytest.fixture(scope="module")
def cluster(three_hosts, tiny_model_dir, tmp_path_factory):
    """The Ray head (no CPUs) on the learner's host, a Ray worker host (one CPU), `grpoflow serve` on the
    third host with the learner's store hidden; each host with a folder of its own in `tmp`."""
    learner, worker, server = three_hosts
    tmp = tmp_path_factory.mktemp("hosts-ray")
    store, root = tmp / "store", tmp / "server-root"
    store.mkdir(), root.mkdir()
    head = _start_ray(learner, tmp, "--head", f"--port={RAY_PORT}", "--num-cpus=0")
    wait_for(lambda: _up(learner, RAY_PORT, head, "ray start --head"), 120, "the Ray head on the learner's host",
             why=lambda: _log(tmp, f"ray-{learner.name}.log"))  # fmt: skip
    joining = _start_ray(worker, tmp, f"--address={learner.address}:{RAY_PORT}", "--num-cpus=1")
    serve = [sys.executable, "-m", "grpoflow.flows.cli", "serve", "--model", str(tiny_model_dir), "--host",
             server.address, "--port", str(SERVE_PORT), "--root", str(root)]  # fmt: skip
    with open(tmp / "serve.log", "ab") as log:
        served = server.run(serve, hide=[store], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=_env(root / "prefect") | {"GRPOFLOW_API_KEY": KEY})  # fmt: skip
    wait_for(lambda: _healthy(server.url(SERVE_PORT), served), 600, "grpoflow serve on the third host",
             why=lambda: _log(tmp, "serve.log"))  # fmt: skip
    _wait_nodes(learner, 2, tmp, worker, joining)  # the run's rewards need the worker's CPU
    return tmp, store


def _env(prefect_home: Path) -> dict[str, str]:
    """The environment of a process on a host: its own Prefect (the session's API is on this machine's
    loopback, which no host reaches)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env | {"PREFECT_HOME": str(prefect_home)}


def _wait_nodes(learner: Host, n: int, tmp: Path, joining: Host, proc: subprocess.Popen) -> None:
    """Until the cluster has `n` live nodes, the last one `joining`'s (`proc`: its `ray start`)."""
    nodes = f"import ray; ray.init(address='{learner.address}:{RAY_PORT}'); print(sum(x['Alive'] for x in ray.nodes()))"

    def joined() -> bool:
        assert proc.poll() is None, f"ray start on {joining.name} exited ({proc.returncode})"
        return learner.check_output([sys.executable, "-c", nodes], timeout_s=60).strip() == str(n)

    wait_for(
        joined, 120, f"{joining.name}'s Ray node to join", why=lambda: _log(tmp, f"ray-{joining.name}.log")
    )


def test_a_run_across_three_hosts_records_where_everything_ran(three_hosts, tiny_model_dir, cluster):
    learner, worker, server = three_hosts
    tmp, store = cluster
    config = tmp / "config" / "run.yaml"
    config.parent.mkdir()
    config.write_text(CONFIG.replace("MODEL", str(tiny_model_dir)).replace("STEPS", str(STEPS)))
    sets = [f"storage.root={store}", f"inference.url={server.url(SERVE_PORT)}", f"inference.api_key={KEY}",
            f"scale.ray_address={learner.address}:{RAY_PORT}"]  # fmt: skip
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "train", "--config", str(config), "--run-id", "three"]
    train = learner.run([*cmd, *(a for s in sets for a in ("--set", s))], cwd=REPO, env=_env(tmp / "prefect"),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out, _ = train.communicate(timeout=600)
    assert train.returncode == 0, out[-4000:]

    # every cell scored on the worker host, none failed there (an empty completion may be invalid)
    assert query(store, "SELECT node, count(*), count(*) FILTER (WHERE status IN ('failed', 'timeout')) "
                        "FROM rewards GROUP BY node")[1] == [(worker.address, STEPS * 16, 0)]  # fmt: skip
    assert query(store, "SELECT DISTINCT server FROM rollouts")[1] == [(server.url(SERVE_PORT),)]
    pushes = query(store, 'SELECT "sync/network_servers" FROM steps WHERE "sync/version" IS NOT NULL')[1]
    assert pushes and all(n == 1 for (n,) in pushes)


def test_two_learner_ranks_on_two_hosts_make_the_single_process_update(three_hosts, tiny_model_dir, cluster):
    learner, worker, server = three_hosts
    tmp, _ = cluster
    joining = _start_ray(server, tmp, f"--address={learner.address}:{RAY_PORT}", "--num-cpus=1")
    _wait_nodes(learner, 3, tmp, server, joining)
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.hosts_learner",
        f"{learner.address}:{RAY_PORT}",
        str(tiny_model_dir),
    ]
    run = learner.run(cmd, cwd=REPO, env=_env(tmp / "prefect-learner"), stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-4000:]
    got = json.loads(next(line for line in out.splitlines() if line.startswith('{"nodes"')))
    assert sorted(got["nodes"]) == sorted([worker.address, server.address])  # a rank on each host
    assert got["worst"] < WEIGHT_ATOL, got
    assert got["loss"][1] == pytest.approx(got["loss"][0], abs=1e-5)
