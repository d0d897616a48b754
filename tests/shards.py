"""`make test`: the whole suite as two pytest processes side by side, then one verdict.

One pytest process kept about half of this 2-core machine busy over test_crash (57%): the rest is
waiting on servers starting, processes dying, subprocesses importing. Two processes fill the gaps, each
with its own session servers (vLLM, Prefect) and its own Prefect home. Over the whole suite here it
saved less than that suggested: 63 minutes against 72 in one process (2026-11-28, a fresh clone), the two
shards slowing each other at a load of 6-15, and two memory-heavy modules at once filled the 24 GB
(hence the lock of tests/conftest.py). On a machine with more cores and memory this pays more;
`make test-serial` runs the suite in one process.

Shard B takes the unit tier and every test that touches state of the whole machine: Ray clusters, the
hosts' network namespaces, scans of the process table for Ray ranks (test_sharded_learner), and the
SmolLM2 tools run. One process runs them one after another, so no two of them overlap. Shard A takes
every other integration file, new ones included by default.

Shard A streams its output; shard B writes to `<basetemp>/shard-b.log`, printed whole after shard A
ends, so each shard's report reads as one pytest run. The exit status fails if either shard fails.
Interrupted (Ctrl-C, SIGTERM), both shards get SIGINT, so their fixtures tear down their servers.

    python -m tests.shards [pytest args...]     # what `make test` runs, PYTEST_ARGS to both
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INTEGRATION = REPO / "tests" / "integration"
# Shard B's integration files: machine-wide state (Ray, namespaces, process-table scans) and long
# self-contained runs, balanced against shard A by CI durations (about equal halves).
SHARD_B = (
    "test_distributed.py",
    "test_guard.py",
    "test_hosts_push.py",
    "test_hosts_ray.py",
    "test_mcp.py",
    "test_openenv.py",
    "test_ray.py",
    "test_server_env.py",
    "test_sharded_learner.py",
    "test_smollm2.py",
)


def shards() -> tuple[list[str], list[str]]:
    """(shard A's paths, shard B's), relative to the repository, in the order each runs them. Shard A
    runs its memory-heavy modules first: they hold the machine-wide lock (tests/conftest.py) while
    shard B runs the unit tier, which takes none, instead of waiting for shard B's heavy modules (8 of
    shard A's 57 minutes went to that wait when it ran them in name order)."""
    files = sorted(p.name for p in INTEGRATION.glob("test_*.py"))
    if missing := sorted(set(SHARD_B) - set(files)):
        raise SystemExit(f"tests/shards.py: SHARD_B names files that do not exist: {missing}")
    a = sorted((f for f in files if f not in SHARD_B), key=lambda f: not memory_heavy(INTEGRATION / f))
    b = ["tests/unit", *(f"tests/integration/{f}" for f in SHARD_B)]
    return [f"tests/integration/{f}" for f in a], b


def memory_heavy(path: Path) -> bool:
    """Is the test module at `path` marked memory_heavy (its `pytestmark`)?"""
    return "pytest.mark.memory_heavy" in path.read_text()


def main(argv: list[str]) -> int:
    a, b = shards()
    base = Path(tempfile.mkdtemp(prefix="grpoflow-shards-"))
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, paths: list[str], out) -> None:
        env = shard_env(name, base)
        cmd = [sys.executable, "-m", "pytest", *paths, *argv]
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def interrupt(signum, frame) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    log_b = base / "shard-b.log"
    with open(log_b, "wb") as out_b:
        start("b", b, out_b)
        print(
            f"shard B ({len(b)} paths: the unit tier and {len(b) - 1} integration files) -> {log_b}",
            flush=True,
        )
        print(f"shard A ({len(a)} integration files):", flush=True)
        start("a", a, None)
        codes = {name: _wait(p) for name, p in procs.items()}
    print(f"\n{'=' * 30} shard B ({log_b}) {'=' * 30}", flush=True)
    sys.stdout.buffer.write(log_b.read_bytes())
    sys.stdout.flush()
    print(f"\nshard A exit {codes['a']}, shard B exit {codes['b']}", flush=True)
    return 0 if codes == {"a": 0, "b": 0} else 1


# Shard B's session server runs eager, as the suite's other servers do (tests/conftest.py): shard A's
# `vllm_server` keeps the compiled default, which its tests of in-place reloads need, and shard B's four
# tests that use one (the hosts push, OpenEnv, the sharded learner) need none of it (25 s of a start).
EAGER_SHARED_SERVER_ENV = "GRPOFLOW_TESTS_EAGER_SHARED_SERVER"


def shard_env(name: str, base: Path) -> dict[str, str]:
    """The environment of shard `name` ("a" or "b"): its own Prefect home under `base`; shard B's
    shared server eager."""
    env = dict(os.environ, PREFECT_HOME=str(base / f"prefect-home-{name}"))
    if name == "b":
        env[EAGER_SHARED_SERVER_ENV] = "1"
    return env


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except InterruptedError:  # a signal handler ran; keep waiting for the shard's teardown
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
