"""Failpoints (storage/faults.py) and hung user code: a stuck tool or reward never stalls a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpoflow.storage import faults

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def run_py(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_spec_parsing_and_clear_errors():
    assert faults.parse("parquet_write@5:kill, train:sleep=0.25") == [
        ("parquet_write", 5, "kill", 0.0),
        ("train", None, "sleep", 0.25),
    ]
    with pytest.raises(ValueError, match="unknown failpoint 'parket_write'"):
        faults.parse("parket_write:kill")
    with pytest.raises(ValueError, match="hit count must be a positive integer in 'score@x:kill'"):
        faults.parse("score@x:kill")
    assert faults.parse("train@3:wait=/tmp/go") == [("train", 3, "wait", "/tmp/go")]
    with pytest.raises(
        ValueError, match="action must be 'kill', 'sleep=<seconds>' or 'wait=<path>' in 'score:explode'"
    ):
        faults.parse("score:explode")
    with pytest.raises(ValueError, match="in 'score:wait='"):
        faults.parse("score:wait=")


def test_wait_holds_its_hit_until_the_file_exists(tmp_path, monkeypatch):
    """`wait=<path>` holds only its own hit, and only until the file is there."""
    import threading

    go = tmp_path / "go"
    monkeypatch.setattr(faults, "_hits", faults.Counter())
    monkeypatch.setenv(faults.ENV, f"score@2:wait={go}")
    faults.failpoint("score")  # hit 1 passes
    passed = []

    def calls():
        for _ in range(2):  # hits 2 and 3
            faults.failpoint("score")
            passed.append(1)

    t = threading.Thread(target=calls, daemon=True)
    t.start()
    t.join(0.5)  # without its wait, hit 2 would have passed in microseconds
    assert t.is_alive() and passed == []
    go.touch()
    t.join(10)
    assert not t.is_alive() and passed == [1, 1]


def test_failpoints_are_inert_without_the_variable():
    out = run_py(
        f"""
        import os
        from grpoflow.storage.faults import ENV, failpoint
        for p in {faults.POINTS!r}:
            failpoint(p)
            failpoint(p)
        print("inert", flush=True)
        os.environ[ENV] = "score@1:kill"
        failpoint("score")  # its 1st counted call: the ones without the variable were not counted
        print("not killed", flush=True)
        """,
        **{faults.ENV: ""},
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert out.stdout.split() == ["inert"]


def test_kill_fires_at_exactly_the_configured_hit():
    out = run_py(
        """
        from grpoflow.storage.faults import failpoint
        for i in range(1, 6):
            print(i, flush=True)
            failpoint("score")
        """,
        GRPOFLOW_FAULTS="score@3:kill",
    )
    assert out.returncode == -signal.SIGKILL
    assert out.stdout.split() == ["1", "2", "3"]  # killed inside the 3rd call, not before or after


def test_a_kill_publishes_where_it_fired_before_it_fires(tmp_path):
    """GRPOFLOW_FAULTS_RECORD: the kill drills read which (point, hit) killed a launch from this record."""
    out = run_py(
        """
        import os
        from grpoflow.storage.faults import failpoint
        print(os.getpid(), flush=True)
        for _ in range(5):
            failpoint("score")
        """,
        GRPOFLOW_FAULTS="score@2:sleep=0,score@4:kill",
        GRPOFLOW_FAULTS_RECORD=str(tmp_path / "faults" / "run"),
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    pid = int(out.stdout.split()[0])
    (record,) = (tmp_path / "faults" / "run").iterdir()  # one whole file, no temp file beside it
    assert record.name == f"kill-{pid}-score@4.json"
    assert json.loads(record.read_text()) == {"point": "score", "hit": 4, "pid": pid}


def test_atomic_parquet_write_killed_before_rename_leaves_no_visible_file(tmp_path):
    out = run_py(
        f"""
        import pyarrow as pa
        from grpoflow.storage.rollouts import atomic_write_parquet
        atomic_write_parquet(__import__("pathlib").Path({str(tmp_path)!r}) / "step-000000.parquet",
                             pa.table({{"x": [1, 2, 3]}}))
        """,
        GRPOFLOW_FAULTS="parquet_write@1:kill",
    )
    assert out.returncode == -signal.SIGKILL
    assert not list(tmp_path.glob("*.parquet"))  # readers' glob sees nothing
    assert len(list(tmp_path.glob(".step-000000.parquet.*.tmp"))) == 1  # swept on resume


def test_hung_sync_reward_and_tool_are_abandoned_and_the_process_exits():
    """A sync reward and a sync tool that never return: both time out, the step's asyncio.run
    returns, and the interpreter exits (asyncio.to_thread or a ThreadPoolExecutor would join them)."""
    out = run_py(
        """
        import asyncio, threading
        from grpoflow.storage.records import RolloutCompletion, RolloutGroup
        from grpoflow.tasks.config.rewards import RewardConfig
        from grpoflow.tasks.rewards.score import score_groups
        from grpoflow.tasks.rollouts.tools import ParsedCall, ToolBox

        def stuck(completions, **_):
            threading.Event().wait()

        def ok(completions, **_):
            return [1.0] * len(completions)

        def stuck_tool(x: int) -> str:
            threading.Event().wait()

        comp = RolloutCompletion(sample_index=0, completion="a", completion_ids=[1],
                                 completion_mask=[1], logprobs=[-1.0])
        groups = [RolloutGroup(group_id="g", prompt_index=0, prompt="p", prompt_ids=[1],
                               completions=[comp])]
        m = score_groups(groups, [RewardConfig(name="stuck", fn=stuck, timeout_s=0.5, required=False),
                                  RewardConfig(name="ok", fn=ok)])
        print("reward", m["reward/stuck/timeout_rate"], comp.reward)
        box = ToolBox({"stuck_tool": stuck_tool}, timeout_s=0.5)
        rec = asyncio.run(box.call(ParsedCall("stuck_tool", {"x": 1}, "{}"), turn=0))
        print("tool", rec.failed, rec.error)
        """,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "reward 1.0 1.0"  # the optional stuck reward timed out; the run goes on
    assert lines[1] == "tool True tool stuck_tool timed out after 0.5s"
