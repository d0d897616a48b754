"""Reward scoring: the fault matrix, masks, concurrency, event-loop safety, process executor."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time

import pytest

from grpoflow.storage.processes import alive
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query, run_canned
from grpoflow.storage.tables import reward_rows
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.score import RewardImportError, resolve_reward, score_groups, score_groups_async
from tests.support import make_groups, wait_for

pytestmark = pytest.mark.unit


# --- one reward function per failure kind ----------------------------------------------------


def healthy(completions, **_):
    return [float(len(c)) for c in completions]


def raises(completions, **_):
    raise ZeroDivisionError("boom")


def returns_none(completions, **_):
    return [None] * len(completions)


def returns_nan(completions, **_):
    return [math.nan] * len(completions)


def returns_inf(completions, **_):
    return [math.inf] * len(completions)


def wrong_length(completions, **_):
    return [1.0]


def a_string(completions, **_):
    return ["high"] * len(completions)


class Hang:
    """The hanging rewards below block until the test that uses them ends, then note that they got
    past: scoring that returns while `finished` is empty did not wait for them, whatever the machine's
    load (no wall-clock bound). One per test: a thread abandoned by one test notes into its own."""

    current: Hang

    def __init__(self):
        self.release, self.finished = threading.Event(), []

    @classmethod
    def block(cls, name: str) -> None:
        hang = cls.current  # the test's, even if the next test has started by the time it wakes
        hang.release.wait(60)
        hang.finished.append(name)


@pytest.fixture
def hanging_rewards():
    Hang.current = hang = Hang()
    yield hang.finished
    hang.release.set()  # let the abandoned threads return


def sleeps(completions, **_):
    Hang.block("sleeps")
    return [1.0] * len(completions)


async def async_raises(completions, **_):
    await asyncio.sleep(0)
    raise RuntimeError("async boom")


async def async_hangs(completions, **_):
    await asyncio.sleep(60)
    Hang.current.finished.append("async_hangs")
    return [1.0] * len(completions)


def first_invalid(completions, **_):
    return [None] + [1.0] * (len(completions) - 1)


FAULTS = {
    "raises": (raises, "failed", "ZeroDivisionError: boom"),
    "none": (returns_none, "invalid", "returned None"),
    "nan": (returns_nan, "invalid", "non-finite"),
    "inf": (returns_inf, "invalid", "non-finite"),
    "wrong_length": (wrong_length, "failed", "expected 6 values, got 1"),
    "string": (a_string, "failed", "non-numeric"),
    "sleeps": (sleeps, "timeout", "exceeded 0.5s"),
    "async_raises": (async_raises, "failed", "RuntimeError: async boom"),
    "async_hangs": (async_hangs, "timeout", "exceeded 0.5s"),
}


def test_fault_matrix_every_cell_has_the_right_status(hanging_rewards):
    groups = make_groups()
    specs = [RewardConfig(name="healthy", fn=healthy, weight=2.0)] + [
        RewardConfig(name=name, fn=fn, timeout_s=0.5, required=False) for name, (fn, _, _) in FAULTS.items()
    ]
    metrics = score_groups(groups, specs)
    assert hanging_rewards == []  # returned on the 0.5 s timeouts, not after the hanging rewards
    for g in groups:
        for c in g.completions:
            cells = {cell.name: cell for cell in c.reward_cells}
            assert cells["healthy"].status == "valid" and cells["healthy"].value == len(c.completion)
            for name, (_, status, reason) in FAULTS.items():
                assert cells[name].status == status, name
                assert reason in cells[name].reason, (name, cells[name].reason)
                assert cells[name].value is None  # never a silent 0
            # scored in this process, without Ray: every cell, failed or not, names this host
            assert {cell.node for cell in c.reward_cells} == {socket.gethostname()}
            # only the healthy (required) reward counts; optional failures are left out of the sum
            assert c.reward_valid and c.reward == 2.0 * len(c.completion)
            assert "raises (optional): failed" in c.invalid_reason
    assert metrics["reward/raises/failed_rate"] == 1.0 and metrics["reward/sleeps/timeout_rate"] == 1.0
    assert metrics["reward/none/invalid_rate"] == 1.0 and metrics["reward/healthy/invalid_rate"] == 0.0


def test_required_reward_failure_masks_the_completion():
    groups = make_groups(1, 3)
    metrics = score_groups(
        groups, [RewardConfig(name="h", fn=healthy), RewardConfig(name="f", fn=first_invalid)]
    )
    first, *rest = groups[0].completions
    assert (
        not first.reward_valid
        and first.reward is None
        and "f: invalid: returned None" in first.invalid_reason
    )
    assert all(c.reward_valid and c.reward == len(c.completion) + 1.0 for c in rest)
    assert metrics["reward/valid_frac"] == pytest.approx(2 / 3)
    # mean/std over valid cells only: f's valid values are [1, 1]
    assert metrics["reward/f/mean"] == 1.0 and metrics["reward/f/invalid_rate"] == pytest.approx(1 / 3)


def test_reward_receives_columns_prompts_and_environments():
    seen = {}

    def spy(prompts, completions, completion_ids, environments, answer, **kw):
        seen.update(prompts=prompts, answer=answer, envs=environments, kw=kw)
        return [0.0] * len(completions)

    groups = make_groups(2, 2)
    groups[1].completions[0].environment = "env-snapshot"
    score_groups(groups, [RewardConfig(name="spy", fn=spy, kwargs={"scale": 3})])
    assert seen["prompts"] == ["raw 0", "raw 0", "raw 1", "raw 1"]
    assert seen["answer"] == [0, 0, 1, 1] and seen["envs"][2] == "env-snapshot"
    # TRL's keywords besides the config's own
    assert (
        set(seen["kw"]) == {"scale", "trainer_state", "log_extra", "log_metric"} and seen["kw"]["scale"] == 3
    )


def test_all_functions_run_concurrently():
    # Four sync and four async functions, each of which returns only once all eight are inside at the
    # same time: run one after another, the first would wait for the others forever (the 30 s timeout
    # fails the test; it never decides a passing result).
    n, inside, lock, everyone_in = 8, [], threading.Lock(), threading.Event()

    def arrive(name: str) -> None:
        with lock:
            inside.append(name)
            if len(inside) == n:
                everyone_in.set()

    def make_sync(i):
        def f(completions, **_):
            arrive(f"s{i}")
            if not everyone_in.wait(30):
                raise TimeoutError(f"only {inside} got in")
            return [1.0] * len(completions)

        return f

    def make_async(i):
        async def f(completions, **_):
            arrive(f"a{i}")
            deadline = time.monotonic() + 30
            while not everyone_in.is_set():  # the event loop must stay free for the other coroutines
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {inside} got in")
                await asyncio.sleep(0.01)
            return [1.0] * len(completions)

        return f

    specs = [RewardConfig(name=f"s{i}", fn=make_sync(i), timeout_s=60) for i in range(4)] + [
        RewardConfig(name=f"a{i}", fn=make_async(i), timeout_s=60) for i in range(4)
    ]
    metrics = score_groups(make_groups(), specs)
    assert sorted(inside) == sorted(spec.name for spec in specs)  # each got in, once
    assert metrics["reward/valid_frac"] == 1.0  # and each returned its values: all were inside at once


async def test_works_inside_a_running_event_loop():
    groups = make_groups(1, 2)
    metrics = score_groups(groups, [RewardConfig(name="h", fn=healthy)])  # sync API called from a coroutine
    assert metrics["reward/valid_frac"] == 1.0
    metrics = await score_groups_async(make_groups(1, 2), [RewardConfig(name="h", fn=healthy)])
    assert metrics["reward/mean"] == 1.5


def test_process_executor_by_import_path():
    groups = make_groups(1, 3)
    metrics = score_groups(
        groups,
        [RewardConfig(name="letters", fn="grpoflow.examples.rewards:letter_fraction", executor="process")],
    )
    assert [c.reward for c in groups[0].completions] == [1.0, 1.0, 1.0]  # completions are all 'a'
    assert metrics["reward/letters/failed_rate"] == 0.0


def test_nn_module_reward_model_runs_off_the_loop():
    import torch

    class LengthModel(torch.nn.Module):
        def forward(self, completion_ids, **_):
            self.thread = threading.current_thread().name
            return torch.tensor([float(len(ids)) for ids in completion_ids])

    model = LengthModel()
    groups = make_groups(1, 2)
    score_groups(groups, [RewardConfig(name="rm", fn=model)])
    assert [c.reward for c in groups[0].completions] == [1.0, 2.0]
    assert model.thread.startswith("grpoflow-")  # a daemon worker thread, not the event loop


def test_bad_import_path_is_named():
    with pytest.raises(RewardImportError, match="grpoflow.examples.rewards:nope"):
        resolve_reward(RewardConfig(name="x", fn="grpoflow.examples.rewards:nope"))


# --- optional rewards: a missing value is imputed with the group mean --------------------------


def required_len(completions, answer, **_):
    # group 2's third completion fails the required reward: it leaves that group's baseline
    return [
        None if a == 2 and len(c) == 3 else float(len(c)) for c, a in zip(completions, answer, strict=True)
    ]


def optional_by_group(completions, answer, **_):
    # per group g: [fails, 10g + 2, 10g + 3]; group 3: fails everywhere
    return [
        "oops" if len(c) == 1 or a == 3 else 10.0 * a + len(c)
        for c, a in zip(completions, answer, strict=True)
    ]


def test_a_failed_optional_reward_counts_as_its_group_mean(tmp_path):
    groups = make_groups(4, 3)
    specs = [
        RewardConfig(name="req", fn=required_len),
        RewardConfig(name="opt", fn=optional_by_group, weight=0.5, required=False),
    ]
    metrics = score_groups(groups, specs)
    firsts = [g.completions[0] for g in groups]
    # required part 1.0 + 0.5 x mean of the *same group's* valid optional values (not the batch's,
    # 12.5 for group 1 is not 7.5); group 2: only completion 1 is scored (22.0); group 3: nothing to impute
    assert [c.reward for c in firsts] == pytest.approx([1 + 0.5 * 2.5, 1 + 0.5 * 12.5, 1 + 0.5 * 22.0, 1.0])
    assert [c.reward for c in groups[1].completions[1:]] == pytest.approx([2 + 0.5 * 12, 3 + 0.5 * 13])
    assert groups[2].completions[2].reward is None
    for c, mean in zip(firsts, [2.5, 12.5, 22.0, None], strict=True):
        cell = c.reward_cells[1]
        assert cell.status == "failed" and cell.value is None and "non-numeric value 'oops'" in cell.reason
        assert cell.imputed == (mean is not None) and cell.imputed_value == mean
        assert c.reward_valid and "opt (optional): failed" in c.invalid_reason
    assert not any(x.imputed for c in groups[2].completions[1:] for x in c.reward_cells)
    assert metrics["reward/opt/imputed_rate"] == 3 / 12 and metrics["reward/opt/failed_rate"] == 6 / 12

    rows = [r for r in reward_rows(groups, run_id="r", step=0) if r["reward_name"] == "opt"]
    assert [(r["imputed"], r["imputed_value"], r["status"]) for r in rows[:3]] == [
        (True, 2.5, "failed"),
        (False, None, "valid"),
        (False, None, "valid"),
    ]
    store = RolloutStore(tmp_path)
    store.write_rollouts("r", 0, groups)
    store.write_rewards("r", 0, groups)
    back = store.read_groups("r")
    assert [c.reward_cells for g in back for c in g.completions] == [
        c.reward_cells for g in groups for c in g.completions
    ]
    # an imputed cell is still not valid: the canned invalid_rate query keeps its meaning
    cols, out = run_canned(tmp_path, "invalid_rate", "r")
    by_name = {r[cols.index("reward_name")]: r for r in out}
    assert by_name["opt"][cols.index("invalid_rate")] == 0.5
    assert query(tmp_path, "SELECT count(*) FROM rewards WHERE imputed")[1] == [(3,)]
    assert query(tmp_path, "SELECT node, count(*) FROM rewards GROUP BY node")[1] == [
        (socket.gethostname(), 24)
    ]


def required_by_len(completions, **_):
    return [{1: 1.0, 2: 0.0, 3: 1.0}[len(c)] for c in completions]


def optional_fails_on_2(completions, **_):
    return [{1: 1.0, 2: "oops", 3: 0.0}[len(c)] for c in completions]


def test_leave_one_out_advantages_leave_imputed_values_out_of_other_baselines():
    # Scored for real: A (len 1) R 1, O 1; B (len 2) R 0, O failed -> imputed (1 + 0) / 2; C R 1, O 0.
    # Totals 2, 0.5, 1. Leave-one-out per function (hand numbers in test_grpo): 1.5, -1.0, -0.5; on the
    # totals B's imputed 0.5 would enter A's and C's baselines: 1.25, -1.0, -0.25.
    from grpoflow.tasks.advantages import assign_advantages
    from grpoflow.tasks.config.algorithm import AlgorithmConfig

    groups = make_groups(1, 3)
    specs = [
        RewardConfig(name="R", fn=required_by_len),
        RewardConfig(name="O", fn=optional_fails_on_2, required=False),
    ]
    score_groups(groups, specs)
    assert [c.reward for c in groups[0].completions] == pytest.approx([2.0, 0.5, 1.0])
    algorithm = AlgorithmConfig(baseline="leave_one_out", scale="none")
    assign_advantages(groups, step=0, algorithm=algorithm)
    assert [c.advantage for c in groups[0].completions] == pytest.approx([1.5, -1.0, -0.5])
    assert all(c.trained for c in groups[0].completions)


# --- process executor: hung workers are killed, the pool recovers -------------------------------


def test_hung_process_rewards_are_killed_and_the_pool_recovers(tmp_path):
    # timeout_s generous for the good reward: a fresh worker imports prefect (seconds on a busy box)
    good = RewardConfig(name="good", fn="tests.unit.reward_fns:length", executor="process", timeout_s=30)
    hang = RewardConfig(
        name="hang",
        fn="tests.unit.reward_fns:hang_forever",
        executor="process",
        timeout_s=1.0,
        kwargs={"pid_dir": str(tmp_path)},
    )
    for _ in range(2):  # the pool has 2 workers: on the old code two hangs held both for good
        groups = make_groups(1, 3)
        score_groups(groups, [good])  # a warm worker, so the hang starts well inside its 1 s
        assert [c.reward for c in groups[0].completions] == [1.0, 2.0, 3.0]
        score_groups(groups, [hang])
        assert [c.reward_cells[0].status for c in groups[0].completions] == ["timeout"] * 3
    groups = make_groups(1, 3)
    score_groups(groups, [good])
    assert [c.reward_cells[0].status for c in groups[0].completions] == ["valid"] * 3
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert pids
    wait_for(lambda: not any(alive(p) for p in pids), 30, f"the hung workers {pids} to be killed")


def test_a_good_process_reward_survives_a_hang_that_recycles_the_pool(tmp_path):
    # The hang's timeout kills every worker of the pool, the slow good reward's included: its call
    # is retried once on the new pool, within its own timeout.
    slow = RewardConfig(
        name="slow",
        fn="tests.unit.reward_fns:length",
        executor="process",
        timeout_s=60,
        kwargs={"seconds": 3},
    )
    hang = RewardConfig(
        name="hang",
        fn="tests.unit.reward_fns:hang_forever",
        executor="process",
        timeout_s=1.0,
        required=False,
        kwargs={"pid_dir": str(tmp_path)},
    )
    groups = make_groups(1, 3)
    score_groups(groups, [slow, hang])
    assert [[x.status for x in c.reward_cells] for c in groups[0].completions] == [["valid", "timeout"]] * 3
    assert [c.reward for c in groups[0].completions] == [1.0, 2.0, 3.0]


# --- async rewards that block, rewards that raise TimeoutError themselves ------------------------


async def blocks_the_loop(completions, **_):
    Hang.block("blocks_the_loop")  # a sync call inside async def: on a shared event loop it would stall all
    return [1.0] * len(completions)


async def async_slow(completions, **_):
    await asyncio.sleep(0.5)
    return [2.0] * len(completions)


def test_a_blocking_async_reward_is_cut_off_and_delays_nobody(hanging_rewards):
    groups = make_groups(1, 2)
    specs = [
        RewardConfig(name="blocker", fn=blocks_the_loop, timeout_s=1.0, required=False),
        RewardConfig(name="h", fn=healthy),
        RewardConfig(name="a", fn=async_slow),
    ]
    score_groups(groups, specs)
    assert hanging_rewards == []  # returned on the 1 s timeout while the blocker still blocks
    for c in groups[0].completions:
        assert [x.status for x in c.reward_cells] == ["timeout", "valid", "valid"]
        assert c.reward == len(c.completion) + 2.0


def raises_timeout(completions, **_):
    raise TimeoutError("my message")


async def async_raises_timeout(completions, **_):
    await asyncio.sleep(0)
    raise TimeoutError("my message")


@pytest.mark.parametrize(
    "fn, executor",
    [
        (raises_timeout, "thread"),
        (async_raises_timeout, "thread"),
        ("tests.unit.reward_fns:raises_timeout", "process"),
    ],
)
def test_a_reward_raising_timeout_error_failed_rather_than_timed_out(fn, executor):
    groups = make_groups(1, 2)
    score_groups(groups, [RewardConfig(name="t", fn=fn, timeout_s=30, executor=executor)])
    for c in groups[0].completions:
        (cell,) = c.reward_cells
        assert cell.status == "failed" and "TimeoutError: my message" in cell.reason, cell
        assert cell.duration_s < 30
