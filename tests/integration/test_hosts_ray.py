"""grpoflow across three hosts (issue 47; tests/hosts.py: network namespaces on a bridge), deployed with
prefect.yaml as shipped:
- the learner's host: a Ray head with no CPUs of its own and a Prefect worker of the `gpu` pool's
  default queue (GRPOFLOW_API_KEY and the allow-lists in its environment);
- a second host: the Prefect server (`prefect server start`) and a Ray worker (one CPU);
- a third host: a Prefect worker of the `gpu` pool's `policy-server` queue, in a mount namespace where
  the learner's store is an empty tmpfs, running the `policy-server` deployment (the long-lived vLLM
  server; every version reaches it over the network).
`grpo-train`, started through the Prefect server's API, runs on the learner's host, scores its rewards
on the Ray worker and generates on the policy server; where each thing ran is read from the store alone.
`grpo-retrain` then continues the lineage and promotes its candidate into the policy server. Last, the
third host joins the Ray cluster and a sharded learner of two ranks, one on each host with CPUs (gloo
over the bridge), makes the single process's update. Everything stays up for the module until the last
test kills the second host under a `grpoflow train` whose Prefect API it is."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpoflow.flows.processes.launch import is_healthy
from grpoflow.storage.sql import query
from tests.hosts import Host, ray_node
from tests.integration.test_distributed import WEIGHT_ATOL
from tests.support import REPO, hosts_fixture, logprob_gap, served_samples, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.memory_heavy]
KEY, SERVE_PORT, RAY_PORT, PREFECT_PORT, STEPS = "hosts-ray-key", 8766, 6379, 4200, 2
PREFECT = str(Path(sys.executable).with_name("prefect"))
DRAIN_S = 5  # GRPOFLOW_PREFECT_DRAIN_S of the run whose Prefect server's host dies
PROBES = [[3 + (5 * i + 11 * k) % 90 for k in range(5 + 4 * i)] for i in range(3)]

three_hosts = hosts_fixture(3, prefix="gr", scope="module")
_TEMPS: list[Path] = []  # the Ray nodes' temp folders


@pytest.fixture(scope="module", autouse=True)
def _remove_temps():
    yield
    for t in _TEMPS:
        shutil.rmtree(t, ignore_errors=True)


def run_config(tiny_model_dir: Path, store: Path, url: str, ray: str) -> dict:
    """A short run as the UI's form sends it: no key in it (the learner's worker has it)."""
    return {
        "model": {"path": str(tiny_model_dir)},
        "data": {"generator": "grpoflow.examples.envs:letters_rows", "generator_kwargs": {"n": 16},
                 "prompts_per_step": 4},
        "generation": {"group_size": 4, "max_tokens": 8},
        "rewards": [{"name": "letter", "fn": "grpoflow.examples.rewards:letter_fraction",
                     "kwargs": {"target_letter": "a"}, "executor": "ray"}],
        "algorithm": {"max_staleness": 0},
        "run": {"steps": STEPS, "run_id": "three"},
        "storage": {"root": str(store)},
        "inference": {"url": url},
        "scale": {"ray_address": ray},
    }  # fmt: skip


def _start_ray(host: Host, tmp: Path, *args: str) -> subprocess.Popen:
    """A Ray node on `host` (tests/hosts.py: ray_node), its temp folder removed with the module's hosts."""
    temp = Path(tempfile.mkdtemp(prefix=f"{host.name}-", dir="/tmp"))
    _TEMPS.append(temp)
    log = open(tmp / f"ray-{host.name}.log", "ab")  # noqa: SIM115 (the process keeps its own descriptor)
    with log:
        return host.run(ray_node(host, temp, *args), env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                        stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def _up(host: Host, port: int, proc: subprocess.Popen, what: str) -> bool:
    assert proc.poll() is None, f"{what} exited ({proc.returncode})"
    return host.answers(port)


def _healthy(url: str, proc: subprocess.Popen, what: str) -> bool:
    assert proc.poll() is None, f"{what} exited ({proc.returncode})"
    return is_healthy(url)  # /health needs no key


def _log(tmp: Path, name: str) -> str:
    path = tmp / name
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {name})"


@dataclass
class Cluster:
    tmp: Path  # logs, the store, the server host's own root
    store: Path  # the learner's store (hidden on the server host)
    api: str  # the Prefect server's API, on the second host
    url: str  # the policy server, on the third host
    ray: str  # the Ray head, on the learner's host


@pytest.fixture(scope="module")
def cluster(three_hosts, tiny_model_dir, tmp_path_factory):
    """The Ray head and worker, the Prefect server, prefect.yaml deployed from the learner's host, a
    worker on the learner's and on the server's host, and the policy-server deployment serving."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    learner, worker, server = three_hosts
    tmp = tmp_path_factory.mktemp("hosts-ray")
    store, root = tmp / "store", tmp / "server-root"
    store.mkdir(), root.mkdir()
    head = _start_ray(learner, tmp, "--head", f"--port={RAY_PORT}", "--num-cpus=0")
    wait_for(lambda: _up(learner, RAY_PORT, head, "ray start --head"), 120, "the Ray head on the learner's host",
             why=lambda: _log(tmp, f"ray-{learner.name}.log"))  # fmt: skip
    joining = _start_ray(worker, tmp, f"--address={learner.address}:{RAY_PORT}", "--num-cpus=1")
    api, url, ray = worker.url(PREFECT_PORT, "/api"), server.url(SERVE_PORT), f"{learner.address}:{RAY_PORT}"
    prefect = _spawn(worker, tmp, "prefect-server", [PREFECT, "server", "start", "--host", worker.address,
                     "--port", str(PREFECT_PORT)], env=_env(tmp / "prefect-server"))  # fmt: skip
    wait_for(lambda: _healthy(api, prefect, "prefect server start"), 300, "the Prefect server on the second host",
             why=lambda: _log(tmp, "prefect-server.log"))  # fmt: skip
    # The user's side: pools and deployments from the learner's checkout, against that server.
    client = _env(tmp / "prefect-client", api)
    for pool in ("gpu", "cpu"):
        learner.check_output([PREFECT, "work-pool", "create", pool, "--type", "process", "--overwrite"],
                             cwd=REPO, env=client, timeout_s=300)  # fmt: skip
    learner.check_output([PREFECT, "--no-prompt", "deploy", "--all"], cwd=REPO, env=client, timeout_s=300)
    # Each worker's own settings: the servers' key, what its runs may read and contact.
    roots = lambda *dirs: os.pathsep.join(map(str, [REPO, tiny_model_dir.parent, *dirs]))  # noqa: E731
    _spawn(server, tmp, "worker-server", [PREFECT, "worker", "start", "--pool", "gpu", "--work-queue",
           "policy-server"], hide=[store], env=_env(root / "prefect", api) | {"GRPOFLOW_API_KEY": KEY,
           "GRPOFLOW_ALLOWED_ROOTS": roots(root)})  # fmt: skip
    _spawn(learner, tmp, "worker-learner", [PREFECT, "worker", "start", "--pool", "gpu", "--work-queue",
           "default"], env=_env(tmp / "prefect-learner", api) | {"GRPOFLOW_API_KEY": KEY,
           "GRPOFLOW_ALLOWED_ROOTS": roots(tmp), "GRPOFLOW_ALLOWED_SERVERS": f"{url},ray://{ray}"})  # fmt: skip
    with temporary_settings(updates={PREFECT_API_URL: api}):
        run_deployment("policy-server/policy-server", timeout=0, parameters={"model_dir": str(tiny_model_dir),
                       "host": server.address, "port": SERVE_PORT, "root": str(root)})  # fmt: skip
    logs = lambda: _log(tmp, "worker-server.log") + _log(tiny_model_dir.parent, f"vllm-{SERVE_PORT}.log")  # noqa: E731
    wait_for(lambda: is_healthy(url), 600, "the policy-server deployment on the third host", 1, why=logs)
    _wait_nodes(learner, 2, tmp, worker, joining)  # the run's rewards need the worker's CPU
    return Cluster(tmp, store, api, url, ray)


def _spawn(host: Host, tmp: Path, name: str, cmd: list[str], **run) -> subprocess.Popen:
    with open(tmp / f"{name}.log", "ab") as log:
        return host.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, **run)


def _env(prefect_home: Path, api: str | None = None) -> dict[str, str]:
    """The environment of a process on a host: its own Prefect home, and `api` (None: a Prefect of its
    own; the session's API is on this machine's loopback, which no host reaches)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GRPOFLOW_API_KEY")}
    env |= {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return env | ({"PREFECT_API_URL": api} if api else {})


def _wait_nodes(learner: Host, n: int, tmp: Path, joining: Host, proc: subprocess.Popen) -> None:
    """Until the cluster has `n` live nodes, the last one `joining`'s (`proc`: its `ray start`)."""
    nodes = f"import ray; ray.init(address='{learner.address}:{RAY_PORT}'); print(sum(x['Alive'] for x in ray.nodes()))"

    def joined() -> bool:
        assert proc.poll() is None, f"ray start on {joining.name} exited ({proc.returncode})"
        return learner.check_output([sys.executable, "-c", nodes], timeout_s=60).strip() == str(n)

    wait_for(
        joined, 120, f"{joining.name}'s Ray node to join", why=lambda: _log(tmp, f"ray-{joining.name}.log")
    )


def _deployment_run(c: Cluster, name: str, parameters: dict, worker_log: str):
    """Run deployment `name` through the Prefect server's API until it ends; its flow run."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: c.api}):
        run = run_deployment(name, parameters=parameters, timeout=900)
    assert run.state.is_completed(), f"{run.state}\n{_log(c.tmp, worker_log)}"
    return run


def test_grpo_train_from_the_prefect_server_runs_on_the_learners_host_across_three_hosts(three_hosts,
                                                                                         tiny_model_dir, cluster):  # fmt: skip
    _, worker, _ = three_hosts
    c = cluster
    run = _deployment_run(c, "grpo-train/grpo-train",
                          {"config": run_config(tiny_model_dir, c.store, c.url, c.ray)}, "worker-learner.log")  # fmt: skip
    assert run.work_queue_name == "default"  # the learner host's worker took it (the only one on that queue)
    meta = json.loads((c.store / "runs" / "three.json").read_text())
    assert meta["status"] == "completed" and str(run.id) in meta["flow_runs"]
    assert KEY not in json.dumps(meta) + json.dumps(run.parameters)  # the key stayed in the worker's env
    # every cell scored on the worker host, none failed there (an empty completion may be invalid)
    assert query(c.store, "SELECT node, count(*), count(*) FILTER (WHERE status IN ('failed', 'timeout')) "
                          "FROM rewards GROUP BY node")[1] == [(worker.address, STEPS * 16, 0)]  # fmt: skip
    assert query(c.store, "SELECT DISTINCT server FROM rollouts")[1] == [(c.url,)]
    pushes = query(c.store, 'SELECT "sync/network_servers" FROM steps WHERE "sync/version" IS NOT NULL')[1]
    assert pushes and all(n == 1 for (n,) in pushes)


def test_grpo_retrain_promotes_into_the_policy_server_on_its_host(tiny_model_dir, cluster):
    """The lineage trained above, one step more; the gate (a margin no candidate can miss) promotes it
    into the policy server over the network: the server then serves the candidate's weights."""
    from grpoflow.storage.promotions import PromotionLog

    c = cluster
    params = {"lineage": "three", "extra_steps": 1, "config": run_config(tiny_model_dir, c.store, c.url, c.ray),
              "config_file": None, "server_url": c.url, "eval_prompts": 4, "gate_margin": -2.0}  # fmt: skip
    _deployment_run(c, "grpo-retrain/grpo-retrain", params, "worker-learner.log")
    meta = json.loads((c.store / "runs" / "three.json").read_text())
    assert [r["decision"] for r in meta["retrains"]] == ["promoted"] and meta["retrains"][0][
        "to_step"
    ] == STEPS
    log = PromotionLog(c.store)
    serving, last = log.serving("three"), log.history("three")[-1]
    assert serving["step"] == STEPS and last["server"] == c.url, last
    assert (
        logprob_gap(serving["path"], served_samples(c.url, PROBES, api_key=KEY, max_tokens=12, seed=9)) < 1e-3
    )


def test_two_learner_ranks_on_two_hosts_make_the_single_process_update(three_hosts, tiny_model_dir, cluster):
    learner, worker, server = three_hosts
    tmp = cluster.tmp
    joining = _start_ray(server, tmp, f"--address={learner.address}:{RAY_PORT}", "--num-cpus=1")
    _wait_nodes(learner, 3, tmp, server, joining)
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.hosts_learner",
        f"{learner.address}:{RAY_PORT}",
        str(tiny_model_dir),
    ]
    run = learner.run(cmd, cwd=REPO, env=_env(tmp / "prefect-ranks"), stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-4000:]
    got = json.loads(next(line for line in out.splitlines() if line.startswith('{"nodes"')))
    assert sorted(got["nodes"]) == sorted([worker.address, server.address])  # a rank on each host
    assert got["worst"] < WEIGHT_ATOL, got
    assert got["loss"][1] == pytest.approx(got["loss"][0], abs=1e-5)


def test_a_run_whose_prefect_server_host_dies_trains_every_step_and_exits(
    three_hosts, tiny_model_dir, cluster
):
    """Last: it kills the second host (the Prefect server and a Ray worker). `grpoflow train` on the
    learner's host, its Prefect API that host's, loses it after its first step: every step is trained and
    stored exactly once, and the command exits 0, saying that Prefect recorded neither the flow run's end nor
    its last logs and events, instead of retrying each of them for hours (flows/processes/prefect_api.py).
    It gives them DRAIN_S (GRPOFLOW_PREFECT_DRAIN_S), not the default 30 s: the bound is what is tested."""
    from grpoflow.storage.rollouts import RolloutStore

    learner, worker, _ = three_hosts
    c, steps = cluster, 3
    cfg = run_config(tiny_model_dir, c.store, c.url, c.ray)
    cfg["rewards"][0]["executor"] = "thread"  # the Ray worker dies with the host: thread rewards
    cfg["run"] |= {"steps": steps, "run_id": "orphan", "checkpoint_every": 1}
    (c.tmp / "orphan.yaml").write_text(json.dumps(cfg))  # YAML's flow style
    # Prefect's client gives up on the dead server at once, not after its default five retries (~1.5 min
    # more here, at the flow run's last state call; one retry took 32 s: benchmarks/host_drills.py runs
    # with the default)
    env = _env(c.tmp / "prefect-orphan", c.api) | {
        "GRPOFLOW_API_KEY": KEY,
        "PREFECT_CLIENT_MAX_RETRIES": "0",
        "GRPOFLOW_PREFECT_DRAIN_S": str(DRAIN_S),
        # held after step 0's checkpoint (its rows land before it) until the host is dead: no race
        "GRPOFLOW_FAULTS": f"checkpoint_done@1:wait={c.tmp / 'prefect-host-dead'}",
    }
    cli = str(Path(sys.executable).with_name("grpoflow"))
    run = learner.run([cli, "train", "--config", str(c.tmp / "orphan.yaml")], cwd=REPO, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    store = RolloutStore(c.store)
    wait_for(lambda: store.steps_written("steps", "orphan") or run.poll() is not None, 600, "step 0 stored")
    assert run.poll() is None, run.communicate()
    worker.kill()
    (c.tmp / "prefect-host-dead").touch()
    try:
        out, err = run.communicate(timeout=300 + DRAIN_S)  # without the bounded exit: hours
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, err[-4000:]
    assert f"run orphan: completed, {steps} steps in the store" in out, out
    assert "warning: the Prefect API did not record the end of run orphan's flow run" in err, err[-4000:]
    assert (
        f"the Prefect API at {c.api} took not all of this run's logs and events within {DRAIN_S} s" in err
    ), err[-4000:]
    for table in ("rollouts", "rewards", "steps"):
        assert store.steps_written(table, "orphan") == list(range(steps)), table
    assert store.read_run_meta("orphan")["status"] == "completed"
