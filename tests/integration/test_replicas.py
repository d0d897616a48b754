"""Two embedded vLLM CPU servers (`inference.replicas: 2`) with the tiny model: groups spread over
both, one is SIGKILLed mid-run, the run goes on the other, the killed one is restarted and rejoins at
the current weights, and nothing is left running afterwards. Real servers, real Prefect, real SQL."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

from grpoflow.examples.rewards import letter_fraction
from grpoflow.storage.processes import is_alive
from grpoflow.storage.sql import query
from grpoflow.tasks.rollouts.replicas import ReplicaSet
from tests.support import REPO, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.memory_heavy]

KILL_AFTER_STEP, STEPS = 2, 14
killed, rejoined = threading.Event(), threading.Event()
served: list[tuple[int, int]] = []  # (replica index, version it serves) each time one rejoins


def gated_letter(completions, **kw):
    """letter_fraction, except that once the replica is killed the batch being scored waits until it
    has been restarted (up to 5 min): the run then has steps left for the revived server to serve."""
    if killed.is_set():
        rejoined.wait(300)
    return letter_fraction(completions, **kw)


def _record(root: Path, name: str) -> dict | None:
    try:
        return json.loads((root / "pids" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _kill_then_watch(root: Path, name: str, errors: list, seen: list) -> None:
    """SIGKILL replica r1 once step KILL_AFTER_STEP is stored; then wait for its restart. Every
    server process record it sees goes to `seen`."""
    try:
        marker = root / "steps" / "run_id=rep" / f"step-{KILL_AFTER_STEP:06d}.parquet"
        wait_for(marker.exists, 600, f"the run to store step {KILL_AFTER_STEP}")
        rec = _record(root, name)
        seen += [rec, _record(root, "vllm-rep")]
        killed.set()
        os.killpg(int(rec["pid"]), signal.SIGKILL)

        def restarted() -> dict | None:  # a new process, answering: the reviver restarted it
            now = _record(root, name)
            return now if now and now["pid"] != rec["pid"] and _healthy(now["url"]) else None

        seen.append(wait_for(restarted, 600, "the killed replica's restart", interval_s=0.5))
        # then it loads the weights the other serves and rejoins the rotation at their version
        wait_for(lambda: any(index == 1 for index, _ in served), 300, "r1 to rejoin at the served version")
    except BaseException as e:
        errors.append(e)
    finally:
        rejoined.set()


@pytest.mark.slow
def test_two_replicas_survive_a_sigkill_and_the_killed_one_rejoins(
    tmp_path, tiny_model_dir, prefect_api, monkeypatch
):
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train

    sets = [
        f"storage.root={tmp_path}",
        f"model.path={tiny_model_dir}",
        "inference.replicas=2",
        "inference.max_model_len=256",
        "inference.retries=2",
        f"run.steps={STEPS}",
        "run.run_id=rep",
        "run.checkpoint_every=100",
        "rewards=[{name: letter, fn: 'tests.integration.test_replicas:gated_letter', "
        "kwargs: {target_letter: a}, timeout_s: 600}]",
    ]
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", sets)
    rejoin = ReplicaSet._rejoin

    def noting_rejoin(self, rep):
        """The reviver's last step: True once `rep` serves the current version and is back in the rotation."""
        back = rejoin(self, rep)
        if back:
            served.append((rep.index, rep.versions.get()))
        return back

    monkeypatch.setattr(ReplicaSet, "_rejoin", noting_rejoin)
    errors, seen = [], []
    watcher = threading.Thread(
        target=_kill_then_watch, args=(tmp_path, "vllm-rep-r1", errors, seen), daemon=True
    )
    watcher.start()
    try:
        summary = grpo_train(config=cfg)
    finally:
        rejoined.set()
        watcher.join(10)
    assert not errors, errors
    assert summary["steps_trained"] == STEPS
    _, counts = query(tmp_path, "SELECT step, count(*) FROM rollouts GROUP BY step ORDER BY step")
    assert counts == [(s, 64) for s in range(STEPS)]  # every step once, whole

    _, rows = query(
        tmp_path,
        "SELECT step, list(DISTINCT server ORDER BY server), min(policy_version), max(policy_version) "
        "FROM rollouts GROUP BY step ORDER BY step",
    )
    both = set(rows[0][1])
    assert len(both) == 2 and all(set(r[1]) == both for r in rows[: KILL_AFTER_STEP + 1])  # groups spread
    _, srows = query(
        tmp_path,
        'SELECT step, "gen/server1/up", "gen/servers_up", server_restarts, policy_version FROM steps ORDER BY step',
    )
    down = [r[0] for r in srows if r[1] == 0.0]
    assert down and min(down) > KILL_AFTER_STEP  # r1 left the rotation after the kill
    back = [r for r in srows if r[0] > max(down)]
    assert back and all(r[1] == 1.0 and r[2] == 2.0 for r in back)  # ... and rejoined
    assert srows[-1][3] >= 1  # restarted by its reviver
    # after rejoining, r1 serves again, at the weights the other serves (versions differ by at most
    # the one push that can be under way between the two servers' reloads)
    assert set(rows[-1][1]) == both and rows[-1][3] - rows[-1][2] <= 1, rows[-1]
    # nothing left running: no record, and every server process seen (r0, r1, r1 restarted) is dead
    assert not list((tmp_path / "pids").glob("vllm-rep*.json"))
    assert len(seen) == 3 and all(is_alive(rec) is False for rec in seen), seen
