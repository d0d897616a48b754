"""Host-kill drills (issue 47): a run across four hosts, one host killed whole (every process SIGKILLed,
its link down) at a random moment, once per kind of host; then what it cost.

Hosts (tests/hosts.py: network namespaces on a bridge; root only):
- `learner`: `grpoflow train` (its Prefect API is the `prefect` host's) and the Ray head, no CPUs;
- `prefect`: the Prefect server (`prefect server start`, its database kept across restarts) and a Ray
  worker with one CPU;
- `ray`: a second Ray worker with one CPU;
- `server`: `grpoflow serve`, the learner's store hidden from it (every version goes over the network).

Drills, each a run of its own killed after a random step (seeded) plus a random delay:
- `ray`: the second Ray worker's host, while it scores rewards (`executor: ray`: two rewards of 0.3 s a
  batch, a CPU each, so each worker host holds one call of every step);
- `rank`: the same host, holding one of the sharded learner's two ranks (`learner.world_size: 2`);
- `prefect`: the Prefect server's host (with the Ray worker on it);
- `learner`: the learner's host (the run and the Ray head with it).
The host then boots again (its processes are started anew; after the learner's, every Ray node joins
the new head), and a run that stopped is resumed (`grpoflow train --resume`).

Per drill, one JSON line: whether the killed run completed by itself, the run's error line naming the
dead host (when it stopped), seconds from the kill to a finished run and of the resume alone, rows lost
and duplicated (rollouts, reward cells, steps rows), reward cells failed or timed out, processes of the
run left on the hosts that lived (Ray workers still running its tasks, a `grpoflow train`), and
whether the server was left paused. Then a table.

    .venv/bin/python benchmarks/host_drills.py [--rounds 1] [--seed 0] [--only ray,prefect]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # grpoflow's packages, `tests.hosts`

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KEY, SERVE_PORT, RAY_PORT, PREFECT_PORT = "host-drills-key", 8767, 6379, 4200
STEPS, PER_STEP, GROUP = 12, 4, 4
KINDS = ("ray", "rank", "prefect", "learner")
REWARDS_PER_COMPLETION = 2  # CONFIG's rewards
# Ray processes that are a node's, not a job's: an idle worker, the node's agents
NODE_DAEMONS = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
CONFIG = """
model: {{path: {model}}}
data: {{generator: "grpoflow.examples.envs:letters_rows", generator_kwargs: {{n: 64}}, prompts_per_step: {per_step}}}
generation: {{group_size: {group}, max_tokens: 8}}
rewards:
  - {{name: letter, fn: "drill_rewards:slow_letter", kwargs: {{target_letter: a}}, executor: {executor}, timeout_s: 60}}
  - {{name: other, fn: "drill_rewards:slow_letter", kwargs: {{target_letter: b}}, executor: {executor}, timeout_s: 60}}
algorithm: {{max_staleness: 1}}
learner: {{world_size: {world}}}
run: {{steps: {steps}, checkpoint_every: 1}}
"""


# The drill's reward, in its config folder (shipped to the Ray workers): letter_fraction after 0.3 s of
# work per batch, so that a kill often lands while a worker host holds a call.
REWARDS = """
import time

from grpoflow.examples.rewards import letter_fraction


def slow_letter(completions, **kw):
    time.sleep(0.3)
    return letter_fraction(completions, **kw)
"""


def wait(cond, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


class Cluster:
    """The four hosts and what runs on each; `boot(host)` starts a host's processes (again)."""

    def __init__(self, hosts, tmp: Path, model: Path):
        self.learner, self.prefect, self.ray, self.server = hosts
        self.tmp, self.model = tmp, model
        self.store, self.root = tmp / "store", tmp / "server-root"
        self.store.mkdir(), self.root.mkdir()
        self.api = self.prefect.url(PREFECT_PORT, "/api")
        self.url = self.server.url(SERVE_PORT)
        self.head = f"{self.learner.address}:{RAY_PORT}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.temps: list[Path] = []  # the Ray nodes' temp folders

    def _spawn(self, host, name: str, cmd: list[str], **run) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GRPOFLOW_API_KEY")}
        env |= {"PREFECT_HOME": str(self.tmp / f"prefect-{name}"), "RAY_USAGE_STATS_ENABLED": "0",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **run.pop("env", {})}  # fmt: skip
        with open(self.tmp / f"{name}.log", "ab") as log:
            p = host.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, **run)
        self.procs[name] = p
        return p

    def _ray(self, host, *args: str) -> None:
        from tests.hosts import ray_node

        temp = Path(tempfile.mkdtemp(prefix=f"{host.name}-", dir="/tmp"))  # socket paths: short
        self.temps.append(temp)
        self._spawn(host, f"ray-{host.name}", ray_node(host, temp, *args))

    def boot(self, host) -> None:
        if host is self.learner:
            self._ray(host, "--head", f"--port={RAY_PORT}", "--num-cpus=0")
            wait(lambda: host.answers(RAY_PORT), 120, "the Ray head")
        elif host is self.prefect:
            self._spawn(host, "prefect-server", [str(BIN / "prefect"), "server", "start", "--host", host.address,
                        "--port", str(PREFECT_PORT)], env={"PREFECT_HOME": str(self.tmp / "prefect-db")})  # fmt: skip
            wait(lambda: host.answers(PREFECT_PORT), 300, "the Prefect server")
            self._ray(host, f"--address={self.head}", "--num-cpus=1")
        elif host is self.ray:
            self._ray(host, f"--address={self.head}", "--num-cpus=1")
        else:
            cmd = [sys.executable, "-m", "grpoflow.flows.cli.main", "serve", "--model", str(self.model), "--host",
                   host.address, "--port", str(SERVE_PORT), "--root", str(self.root)]  # fmt: skip
            self._spawn(host, "serve", cmd, hide=[self.store], env={"GRPOFLOW_API_KEY": KEY})
            from grpoflow.flows.processes.launch import is_healthy

            wait(lambda: is_healthy(self.url), 600, "grpoflow serve")

    def nodes(self) -> int:
        code = f"import ray; ray.init(address='{self.head}'); print(sum(n['Alive'] for n in ray.nodes()))"
        try:
            return int(self.learner.check_output([sys.executable, "-c", code], timeout_s=90).strip())
        except (subprocess.SubprocessError, ValueError):
            return 0

    def restart_ray(self) -> None:
        """After the head's host died: the other nodes leave the dead cluster (their Ray processes,
        found in their own namespace: `ray stop` would kill every host's) and join the new head."""
        for host in (self.prefect, self.ray):
            for pid, cmd in _processes(host):
                if "ray" in cmd:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self.procs.pop(f"ray-{host.name}").wait(30)
            self._ray(host, f"--address={self.head}", "--num-cpus=1")

    def train(self, run_id: str, kind: str, resume: bool = False) -> subprocess.Popen:
        (self.tmp / "drill_rewards.py").write_text(REWARDS)
        cfg = self.tmp / f"{kind}.yaml"
        cfg.write_text(CONFIG.format(model=self.model, per_step=PER_STEP, group=GROUP, steps=STEPS,
                                     executor="thread" if kind == "rank" else "ray",
                                     world=2 if kind == "rank" else 1))  # fmt: skip
        sets = [f"storage.root={self.store}", f"inference.url={self.url}", f"scale.ray_address={self.head}"]
        cmd = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--config", str(cfg),
               *(["--resume", run_id] if resume else ["--run-id", run_id]), *(a for s in sets for a in ("--set", s))]  # fmt: skip
        env = {"PREFECT_API_URL": self.api, "GRPOFLOW_API_KEY": KEY}
        return self._spawn(self.learner, f"train-{run_id}{'-resume' if resume else ''}", cmd, env=env)

    def left_behind(self, run_id: str) -> list[str]:
        """Processes of the run alive on the hosts that lived: Ray workers busy with its tasks or actors
        (named `ray::<task>`), and its `grpoflow train` (host: command, shortened)."""
        out = []
        for host in (self.learner, self.prefect, self.ray, self.server):
            for _, cmd in _processes(host) if host.alive else ():
                busy_ray = cmd.startswith("ray::") and not cmd.startswith(NODE_DAEMONS)
                if busy_ray or ("grpoflow.flows.cli.main train" in cmd and run_id in cmd):
                    out.append(f"{host.name}: {cmd[:60]}")
        return out


def _processes(host) -> list[tuple[int, str]]:
    """(pid, command line) of every process in the host's namespace."""
    out = []
    for pid in subprocess.run(
        ["ip", "netns", "pids", host.name], capture_output=True, text=True
    ).stdout.split():
        with contextlib.suppress(OSError):
            out.append(
                (
                    int(pid),
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
                )
            )
    return out


def counts(store: Path, run_id: str) -> dict:
    from grpoflow.storage.sql import query

    def one(sql: str) -> tuple:
        return query(store, sql.replace("RUN", run_id))[1][0]

    n, distinct = one("SELECT count(*), count(DISTINCT (step, group_id, sample_index)) FROM rollouts "
                      "WHERE run_id = 'RUN' AND split = 'train'")  # fmt: skip
    cells, distinct_cells, bad = one("SELECT count(*), count(DISTINCT (step, group_id, sample_index, reward_name)), "
                                     "count(*) FILTER (WHERE status IN ('failed', 'timeout')) FROM rewards "
                                     "WHERE run_id = 'RUN' AND split = 'train'")  # fmt: skip
    rows, steps = one("SELECT count(*), count(DISTINCT step) FROM steps WHERE run_id = 'RUN'")
    return {
        "rows_lost": STEPS * PER_STEP * GROUP
        - distinct
        + (REWARDS_PER_COMPLETION * distinct - distinct_cells),
        "rows_duplicated": (n - distinct) + (cells - distinct_cells) + (rows - steps),
        "steps_stored": steps,
        "cells_failed": bad,
    }


def paused(url: str) -> bool | None:
    import asyncio

    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def ask():
        async with VLLMClient(url, api_key=KEY, retries=0) as c:
            return await c.is_paused()

    try:
        return asyncio.run(ask())
    except Exception:
        return None


def drill(c: Cluster, kind: str, run_id: str, rng: random.Random) -> dict:
    victim = {"ray": c.ray, "rank": c.ray, "prefect": c.prefect, "learner": c.learner}[kind]
    after = rng.randrange(1, STEPS // 2)  # a step stored before the kill (steps take ~0.5 s here)
    delay = rng.uniform(0.0, 0.3)
    run = c.train(run_id, kind)
    marker = c.store / "steps" / f"run_id={run_id}" / f"step-{after:06d}.parquet"
    wait(lambda: marker.exists() or run.poll() is not None, 900, f"{run_id}: step {after}")
    time.sleep(delay)
    victim.kill()
    t_kill = time.monotonic()
    try:
        code = run.wait(600)  # a run that loses a host it can do without goes on
    except subprocess.TimeoutExpired:
        run.kill()
        code = "hung"
    log = (c.tmp / f"train-{run_id}.log").read_text(errors="replace")
    error = next((ln for ln in log.splitlines()[::-1] if "error" in ln.lower()), "") if code != 0 else ""
    t_done = time.monotonic()
    with contextlib.suppress(TimeoutError):  # the run's processes on the hosts that lived, until none is left
        wait(lambda: not c.left_behind(run_id), 120, "the run's processes to go", 1.0)
    left, release_s = c.left_behind(run_id), round(time.monotonic() - t_done, 1)
    was_paused = paused(c.url) if c.server.alive else None
    victim.revive()
    t_boot = time.monotonic()
    c.boot(victim)
    if victim is c.learner:
        c.restart_ray()
    wait(lambda: c.nodes() == 3, 300, "every Ray node back")
    resume_s = None
    if code != 0:
        t0 = time.monotonic()
        again = c.train(run_id, kind, resume=True)
        resume_code = again.wait(900)
        t_resumed = time.monotonic()
        resume_s = round(t_resumed - t0, 1)
        if resume_code != 0:
            print((c.tmp / f"train-{run_id}-resume.log").read_text(errors="replace")[-3000:], file=sys.stderr)
    return {
        "kind": kind,
        "killed_after_step": after,
        "delay_s": round(delay, 2),
        "completed_alone": code == 0,
        "error": error[:200],
        "names_host": code != 0 and victim.address in log,  # the stopped run's log says which host died
        "boot_s": round(time.monotonic() - t_boot, 1) if resume_s is None else round(t0 - t_boot, 1),
        "resume_s": resume_s,
        "kill_to_done_s": round((t_done if resume_s is None else t_resumed) - t_kill, 1),
        **counts(c.store, run_id),
        "processes_left": len(left),
        "left": sorted(set(left))[:4],
        "released_s": release_s,
        "server_paused": was_paused,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(KINDS), help="comma-separated kinds: " + ", ".join(KINDS))
    ap.add_argument("--model", default=None, help="model dir (default: the tiny model, built here)")
    args = ap.parse_args()
    from grpoflow.tasks.tiny_model import build_tiny_model
    from tests.hosts import Hosts

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="host-drills-"))
    model = Path(args.model) if args.model else build_tiny_model(tmp / "models" / "tiny")
    results, c = [], None
    try:
        with Hosts(4, prefix="gd") as hosts:
            c = Cluster(list(hosts), tmp, model)
            for h in (c.learner, c.prefect, c.ray, c.server):
                c.boot(h)
            wait(lambda: c.nodes() == 3, 300, "the Ray cluster")
            for r in range(args.rounds):
                for kind in args.only.split(","):
                    out = drill(c, kind, f"{kind}-{r}", rng)
                    print(json.dumps(out), flush=True)
                    results.append(out)
    finally:
        for t in [tmp, *(c.temps if c else [])]:
            shutil.rmtree(t, ignore_errors=True)
    cols = ["kind", "completed_alone", "names_host", "kill_to_done_s", "resume_s", "rows_lost", "rows_duplicated",
            "cells_failed", "processes_left", "released_s", "server_paused"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for o in results:
        print("| " + " | ".join(str(o[k]) for k in cols) + " |")


if __name__ == "__main__":
    main()
