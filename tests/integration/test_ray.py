"""`executor: ray` on a real local Ray: rewards and tools match the thread executor cell for cell
(a good one, one that raises, one that hangs and has its worker killed), the user's modules beside
their config reach the workers, and a local Ray has no dashboard, a capped store, and dies with its
run even on SIGKILL. One local Ray serves the module (starting one costs seconds). No vLLM server:
integration for the Ray cluster and the SIGKILLed process tree (tests/unit runs no servers)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.storage.processes import alive, processes, session_pids
from grpoflow.tasks.config.imports import import_object
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.score import score_groups_async
from grpoflow.tasks.rollouts.tools import ParsedCall, ToolBox
from tests.support import REPO, make_groups, wait_for

pytestmark = pytest.mark.integration

USER_FNS = '''
"""A user's reward and tool functions, in a module beside their config."""
import os
import time
from pathlib import Path


def length(completions, **_):
    return [float(len(c)) for c in completions]


def explode(completions, **_):
    raise ZeroDivisionError("boom")


def hang(completions, pid_dir, **_):
    Path(pid_dir, str(os.getpid())).touch()
    while True:
        time.sleep(3600)


def where(completions, project, **_):
    """1.0 when this module is a copy Ray shipped, not the file in the user's folder."""
    return [float(Path(__file__).resolve().parent != Path(project).resolve())] * len(completions)


def add(a: int, b: int):
    return {"sum": a + b}


def tool_explode():
    raise ValueError("bad tool")


def tool_hang(pid_dir: str):
    Path(pid_dir, str(os.getpid())).touch()
    while True:
        time.sleep(3600)
'''

CONFIG = """
scale: {ray_address: local, num_cpus: 2}
data: {generator: "grpoflow.examples.envs:letters_rows"}
rewards: [{name: length, fn: "ray_user_fns:length", executor: ray}]
tools: {tools: ["ray_user_fns:add"], executor: ray}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray for this module, run with a user project: a config file and a module beside it
    (the config's folder is added to this process's import path by load_config, as in a run). Module-
    scoped: a session-long one would keep later tests, whose flows start a Ray of their own, from
    connecting."""
    pytest.importorskip("ray")
    from grpoflow.flows.processes.cluster import ray_cluster

    project = tmp_path_factory.mktemp("project")
    (project / "config.yaml").write_text(CONFIG)
    (project / "ray_user_fns.py").write_text(USER_FNS)
    cfg = load_config(project / "config.yaml")
    with ray_cluster(cfg.scale, cfg.config_dir) as c:
        _score([RewardConfig(name="length", fn="ray_user_fns:length", executor="ray")])  # warm workers
        yield c, project


def _score(specs: list[RewardConfig]):
    groups = make_groups(2, 3)
    asyncio.run(score_groups_async(groups, specs))
    return groups


def _table(groups) -> list:
    """Everything scoring decides, per completion (durations aside)."""
    return [
        (c.reward_valid, c.reward, c.invalid_reason)
        + tuple((x.name, x.status, x.value, x.reason, x.imputed) for x in c.reward_cells)
        for g in groups
        for c in g.completions
    ]


def _specs(executor: str, pid_dir: Path, timeout_s: float = 5.0) -> list[RewardConfig]:
    return [
        RewardConfig(name="length", fn="ray_user_fns:length", executor=executor),
        RewardConfig(name="explode", fn="ray_user_fns:explode", executor=executor, required=False),
        RewardConfig(
            name="hang",
            fn="ray_user_fns:hang",
            executor=executor,
            required=False,
            timeout_s=timeout_s,
            kwargs={"pid_dir": str(pid_dir)},
        ),
    ]


def test_ray_rewards_match_threads_and_a_hung_worker_is_killed(cluster, tmp_path):
    import ray

    on_thread, on_ray = tmp_path / "thread", tmp_path / "ray"
    on_thread.mkdir(), on_ray.mkdir()

    async def both():
        threaded, ray_groups = make_groups(2, 3), make_groups(2, 3)
        await asyncio.gather(
            score_groups_async(threaded, _specs("thread", on_thread)),
            score_groups_async(ray_groups, _specs("ray", on_ray)),
        )
        return threaded, ray_groups

    # `hang` never returns: that scoring ends at all is the cut-off (its cells say `timeout` below).
    threaded, ray_groups = asyncio.run(both())
    assert _table(ray_groups) == _table(threaded)
    cells = {x.name: x for x in ray_groups[0].completions[1].reward_cells}
    assert cells["length"].status == "valid" and cells["length"].value == 2.0
    assert (cells["explode"].status, cells["explode"].reason) == ("failed", "ZeroDivisionError: boom")
    assert (cells["hang"].status, cells["hang"].reason) == ("timeout", "exceeded 5.0s")
    # where each ran: the address of this one-node cluster's node, a failed call's too; a task cut off
    # at its timeout never said
    [node] = [n["NodeManagerAddress"] for n in ray.nodes()]
    assert cells["length"].node == cells["explode"].node == node
    assert cells["hang"].node == ""

    [worker] = [int(p.name) for p in on_ray.iterdir()]  # the Ray worker that ran the hung reward
    assert worker != os.getpid()
    wait_for(lambda: not alive(worker), 15, "the hung reward's worker to be killed")  # nothing stays occupied
    after = _score([RewardConfig(name="length", fn="ray_user_fns:length", executor="ray")])
    assert [c.reward for g in after for c in g.completions] == [1.0, 2.0, 3.0] * 2  # a fresh worker


def test_ray_tools_match_threads(cluster, tmp_path):
    names = ("add", "tool_explode", "tool_hang")
    fns = {n: import_object(f"ray_user_fns:{n}") for n in names}
    calls = [
        ParsedCall("add", {"a": 2, "b": 3}, '{"a": 2, "b": 3}'),
        ParsedCall("tool_explode", {}, "{}"),
        ParsedCall("tool_hang", {"pid_dir": str(tmp_path)}, "..."),
    ]
    threads = ToolBox(fns, timeout_s=5.0)
    ray_box = ToolBox(fns, timeout_s=5.0, remote={n: f"ray_user_fns:{n}" for n in names})

    async def run(box):
        return await asyncio.gather(*(box.call(c, turn=1) for c in calls))

    async def both():
        return await asyncio.gather(run(threads), run(ray_box))

    by_thread, by_ray = asyncio.run(both())

    def table(records):
        return [{k: v for k, v in vars(r).items() if k not in ("duration_s", "node")} for r in records]

    assert table(by_ray) == table(by_thread)
    # where each ran: the Ray task's node (one local node here: this process's), a call cut off unheard
    # none; a thread call, this process's node
    here = by_thread[0].node
    assert here and [r.node for r in by_thread] == [here] * 3 and [r.node for r in by_ray] == [here, here, ""]
    assert json.loads(by_ray[0].result) == {"sum": 5} and not by_ray[0].failed
    assert by_ray[1].failed and by_ray[1].error == "ValueError: bad tool"
    assert by_ray[2].failed and by_ray[2].error == "tool tool_hang timed out after 5.0s"
    workers = [int(p.name) for p in tmp_path.iterdir() if int(p.name) != os.getpid()]
    assert len(workers) == 1
    wait_for(lambda: not alive(workers[0]), 15, "the hung tool's worker to be killed")
    assert threads.timed_out and not ray_box.timed_out  # the killed worker held no local state


def test_modules_beside_the_config_reach_the_workers(cluster):
    _, project = cluster
    assert str(project) not in os.environ.get("PYTHONPATH", "")
    spec = {"name": "where", "fn": "ray_user_fns:where", "kwargs": {"project": str(project)}}
    shipped = _score([RewardConfig(**spec, executor="ray")])
    local = _score([RewardConfig(**spec, executor="thread")])
    assert {c.reward for g in shipped for c in g.completions} == {1.0}  # Ray's copy of the folder
    assert {c.reward for g in local for c in g.completions} == {0.0}


CHILD = """
import sys, time
import ray
from grpoflow.flows.processes.cluster import ray_cluster
from grpoflow.tasks.config.run import ScaleConfig

with ray_cluster(ScaleConfig(ray_address="local", num_cpus=1, object_store_mb=100)) as c:
    @ray.remote
    def busy():
        while True:
            time.sleep(1)
    busy.remote()  # a worker stuck in user code
    store = ray.cluster_resources()["object_store_memory"]
    print(c.head.proc.pid, c.head.temp_dir, store, c.head.log_path, flush=True)
    time.sleep(600)
"""


def test_local_ray_has_no_dashboard_a_capped_store_and_dies_with_its_run():
    pytest.importorskip("ray")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        guard, temp_dir, store, log = child.stdout.readline().split()

        # Read the cluster while its run lives: Ray starts its head process after init returns, and
        # once the run is killed the guard kills them all.
        def head_processes():
            nonlocal members
            sid = int(guard)  # raylet, GCS, agents, workers: all in the guard's session
            procs = [p for p in processes() if p.sid == sid]
            members = [p.pid for p in procs]
            return [" ".join(p.argv) for p in procs if any("dashboard/dashboard.py" in a for a in p.argv)]

        members: list[int] = []
        heads = wait_for(head_processes, 60, "Ray's head process", interval_s=0.5)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # the run dies without any cleanup
        child.wait()
    try:
        assert float(store) == 100 * 1024 * 1024
        assert "dashboard" not in Path(log).read_text().lower()  # ray start announces a dashboard
        assert len(members) >= 3
        # Ray keeps a head process even without a dashboard; it must run with the UI and its
        # modules off, on loopback
        assert all("--disable-frontend" in c and "--host=127.0.0.1" in c for c in heads)
        wait_for(lambda: not any(alive(p) for p in members), 15, "the killed run's Ray processes to go")
        assert session_pids(int(guard)) == []
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # SIGKILL ran no cleanup; the processes are gone
