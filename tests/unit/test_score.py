"""Reward scoring: the fault matrix, masks, concurrency, event-loop safety, process executor."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from storage.records import RolloutCompletion, RolloutGroup
from tasks.score import RewardImportError, RewardSpec, resolve_reward, score_groups, score_groups_async

pytestmark = pytest.mark.unit


def make_groups(n_groups: int = 2, size: int = 3) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            group_id=f"g{g}",
            prompt_index=g,
            prompt=f"<prompt {g}>",
            prompt_ids=[1, 2],
            completions=[
                RolloutCompletion(
                    sample_index=i,
                    completion="a" * (i + 1),
                    completion_ids=[3] * (i + 1),
                    completion_mask=[1] * (i + 1),
                    logprobs=[-1.0] * (i + 1),
                )
                for i in range(size)
            ],
            row={"prompt": f"raw {g}", "answer": g},
        )
        for g in range(n_groups)
    ]


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


def sleeps(completions, **_):
    time.sleep(5)
    return [1.0] * len(completions)


async def async_raises(completions, **_):
    await asyncio.sleep(0)
    raise RuntimeError("async boom")


async def async_hangs(completions, **_):
    await asyncio.sleep(60)
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


def test_fault_matrix_every_cell_has_the_right_status():
    groups = make_groups()
    specs = [RewardSpec("healthy", healthy, weight=2.0)] + [
        RewardSpec(name, fn, timeout_s=0.5, required=False) for name, (fn, _, _) in FAULTS.items()
    ]
    t0 = time.perf_counter()
    metrics = score_groups(groups, specs)
    assert time.perf_counter() - t0 < 4.0  # bounded by the 0.5 s timeouts, not the 5 s / 60 s sleeps
    for g in groups:
        for c in g.completions:
            cells = {cell.name: cell for cell in c.reward_cells}
            assert cells["healthy"].status == "valid" and cells["healthy"].value == len(c.completion)
            for name, (_, status, reason) in FAULTS.items():
                assert cells[name].status == status, name
                assert reason in cells[name].reason, (name, cells[name].reason)
                assert cells[name].value is None  # never a silent 0
            # only the healthy (required) reward counts; optional failures are left out of the sum
            assert c.reward_valid and c.reward == 2.0 * len(c.completion)
            assert "raises (optional): failed" in c.invalid_reason
    assert metrics["reward/raises/failed_rate"] == 1.0 and metrics["reward/sleeps/timeout_rate"] == 1.0
    assert metrics["reward/none/invalid_rate"] == 1.0 and metrics["reward/healthy/invalid_rate"] == 0.0


def test_required_reward_failure_masks_the_completion():
    groups = make_groups(1, 3)
    metrics = score_groups(groups, [RewardSpec("h", healthy), RewardSpec("f", first_invalid)])
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
    score_groups(groups, [RewardSpec("spy", spy, kwargs={"scale": 3})])
    assert seen["prompts"] == ["raw 0", "raw 0", "raw 1", "raw 1"]
    assert seen["answer"] == [0, 0, 1, 1] and seen["envs"][2] == "env-snapshot" and seen["kw"] == {"scale": 3}


def test_all_functions_run_concurrently():
    # Four sync + four async functions that each take 1 s finish in about 1 s, not 8 s.
    started = []

    def make_sync(i):
        def f(completions, **_):
            started.append(("sync", i, time.perf_counter()))
            time.sleep(1.0)
            return [1.0] * len(completions)

        return f

    def make_async(i):
        async def f(completions, **_):
            started.append(("async", i, time.perf_counter()))
            await asyncio.sleep(1.0)
            return [1.0] * len(completions)

        return f

    specs = [RewardSpec(f"s{i}", make_sync(i)) for i in range(4)] + [
        RewardSpec(f"a{i}", make_async(i)) for i in range(4)
    ]
    score_groups(make_groups(), specs)
    starts = sorted(t for *_, t in started)
    # every function started before the first one could have finished: they overlap
    assert starts[-1] - starts[0] < 1.0


async def test_works_inside_a_running_event_loop():
    groups = make_groups(1, 2)
    metrics = score_groups(groups, [RewardSpec("h", healthy)])  # sync API called from a coroutine
    assert metrics["reward/valid_frac"] == 1.0
    metrics = await score_groups_async(make_groups(1, 2), [RewardSpec("h", healthy)])
    assert metrics["reward/mean"] == 1.5


def test_process_executor_by_import_path():
    groups = make_groups(1, 3)
    metrics = score_groups(
        groups, [RewardSpec("letters", "examples.rewards:letter_fraction", executor="process")]
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
    score_groups(groups, [RewardSpec("rm", model)])
    assert [c.reward for c in groups[0].completions] == [1.0, 2.0]
    assert model.thread.startswith("grpoflow-")  # a daemon worker thread, not the event loop


def test_bad_import_path_is_named():
    with pytest.raises(RewardImportError, match="examples.rewards:nope"):
        resolve_reward(RewardSpec("x", "examples.rewards:nope"))
