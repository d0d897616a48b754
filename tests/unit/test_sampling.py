"""DAPO's dynamic sampling and overlong handling: the further rounds' rows, how many prompts a round
generates, which groups a step keeps and why the others drop, the soft overlong penalty's values, and
completions cut at the budget left out of the loss; every expected figure worked out by hand."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from grpoflow.examples.rewards import soft_overlong_penalty
from grpoflow.storage.records import RolloutCompletion, RolloutGroup
from grpoflow.tasks.advantages import assign_advantages
from grpoflow.tasks.config.algorithm import AlgorithmConfig
from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from grpoflow.tasks.rollouts.sampling import EXTRA_BASE, NO_SIGNAL, STEP_FULL, DynamicSampling, select
from grpoflow.tasks.steps import RolloutJob

pytestmark = pytest.mark.unit


def _group(
    index: int, rewards: list[float | None], truncated: tuple[int, ...] = (), row=None
) -> RolloutGroup:
    comps = [
        RolloutCompletion(
            i, "x", [1], [1], [-1.0], reward=r, reward_valid=r is not None, truncated=i in truncated
        )
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(f"train-{index:08d}", index, "p", [0], comps, row=row or {"id": index})


def test_soft_overlong_penalty_is_dapos_linear_ramp():
    # budget 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at the budget and beyond
    lengths = [0, 5, 6, 7, 8, 9, 10, 12]
    got = soft_overlong_penalty([[1] * n for n in lengths], max_tokens=10, buffer=4)
    assert got == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer 11 must be in 1..max_tokens"):
        soft_overlong_penalty([[1]], max_tokens=10, buffer=11)


def test_further_rounds_draw_fixed_rows_in_their_own_index_space():
    rows = [{"id": i} for i in range(10)]
    ds = DynamicSampling(rows, per_step=4, seed=7, max_rounds=3)
    a_rows, a_idx = ds.round_rows(step=5, rnd=1, k=6)
    assert ds.round_rows(step=5, rnd=1, k=6) == (a_rows, a_idx)  # a pure function of (seed, step, round)
    assert len({r["id"] for r in a_rows}) == 6  # distinct rows while the dataset has enough
    assert DynamicSampling(rows, 4, 8, 3).round_rows(5, 1, 6)[0] != a_rows  # another seed, other rows
    b_idx = ds.round_rows(step=5, rnd=2, k=16)[1]
    c_idx = ds.round_rows(step=6, rnd=1, k=16)[1]
    assert min(a_idx) >= EXTRA_BASE  # never a cursor position (step * per_step + i)
    assert not set(a_idx) & set(b_idx) and not set(b_idx) & set(c_idx)  # rounds and steps apart
    assert len(ds.round_rows(step=0, rnd=1, k=12)[0]) == 12  # more than the dataset: rows repeat


@pytest.mark.parametrize(
    ("kept", "generated", "size"),
    [(2, 8, 8), (1, 4, 12), (0, 4, 16), (3, 4, 2), (1, 40, 16)],
)
def test_a_round_generates_what_the_missing_groups_need_at_the_rate_seen(kept, generated, size):
    # per_step 4: missing = 4 - kept at rate kept/generated (1/4 when none yet), at most 16 (4 steps' worth)
    assert DynamicSampling([{}], per_step=4, seed=0, max_rounds=3).next_round_size(kept, generated) == size


def test_select_keeps_the_first_groups_with_signal_and_says_why_the_others_drop():
    groups = [
        _group(0, [1.0, 1.0, 1.0]),  # all equal: no signal
        _group(1, [0.0, 1.0, None]),  # two valid, different: kept
        _group(2, [0.5, None, None]),  # one valid: no signal
        _group(3, [0.1 + 0.2, 0.3, 0.3]),  # equal up to float noise: no signal
        _group(4, [0.0, 0.25, 0.5]),  # kept
        _group(5, [1.0, 0.0, 0.0]),  # signal, but the step is full
    ]
    assert select(groups, per_step=2) == 2
    assert [g.dropped for g in groups] == [NO_SIGNAL, None, NO_SIGNAL, NO_SIGNAL, None, STEP_FULL]


def test_dropped_groups_and_truncated_completions_stay_out_of_the_loss():
    dropped = _group(0, [1.0, 1.0])
    dropped.dropped = NO_SIGNAL
    kept = _group(1, [1.0, 0.0, 1.0, 0.0], truncated=(0,))
    algo = AlgorithmConfig(scale="group", mask_truncated=True)
    metrics = assign_advantages([dropped, kept], step=0, algorithm=algo)
    assert [(c.trained, c.advantage, c.drop_reason) for c in dropped.completions] == [
        (False, 0.0, NO_SIGNAL)
    ] * 2
    # the truncated completion's reward stays in the baseline: mean 0.5, sample std 0.57735
    std = statistics.stdev([1.0, 0.0, 1.0, 0.0])
    assert [c.advantage for c in kept.completions] == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2
    )
    assert [c.trained for c in kept.completions] == [False, True, True, True]
    assert kept.completions[0].drop_reason == "truncated at the token budget (algorithm.mask_truncated)"
    assert metrics["adv/truncated_masked"] == 1.0 and metrics["adv/groups"] == 1.0


def test_a_step_generates_further_rounds_until_it_holds_its_groups(monkeypatch):
    """FAKE generator (the real one needs a server; tests/integration/test_algorithms.py runs this
    through it): each group's completions alternate "a" and "b". The real scorer's reward gives rows
    whose id is a multiple of 3 a spread (1 or 0) and every other row 0.0, so which groups have
    signal is fixed by the rows alone."""
    import grpoflow.tasks.steps as steps

    made: list[list[int]] = []

    async def fake_generate(rows, indices, job):
        made.append(list(indices))
        return [
            RolloutGroup(f"train-{i:08d}", i, "p", [0],
                         [RolloutCompletion(k, "ab"[k % 2], [1], [1], [-1.0]) for k in range(4)], row=row)
            for row, i in zip(rows, indices, strict=True)
        ]  # fmt: skip

    monkeypatch.setattr(steps, "_generate", fake_generate)
    rows = [{"prompt": "p", "id": i} for i in range(30)]
    ds = DynamicSampling(rows, per_step=4, seed=7, max_rounds=3)
    job = RolloutJob(
        tokenizer_path="unused", generation=GenerationConfig(group_size=4), tools=ToolsConfig(),
        rewards=[RewardConfig(name="third", fn="tests.unit.reward_fns:letters_on_every_third_row")],
        inference=InferenceConfig(), seed=7, servers=ReplicaSet([Replica(0, "http://fake.invalid")]), sampling=ds,
    )  # fmt: skip
    step_rows = [rows[i] for i in (1, 2, 3, 4)]  # only id 3 has signal
    batch = asyncio.run(steps._rollout_async(2, step_rows, [8, 9, 10, 11], job))

    # round 0: 1 of 4 with signal -> round 1 asks 3 / (1/4) = 12 prompts; then round 2 if still short
    r1_rows, r1_idx = ds.round_rows(2, 1, 12)
    assert made[0] == [8, 9, 10, 11] and made[1] == r1_idx
    signal = [i for i in (1, 2, 3, 4)] + [r["id"] for r in r1_rows]
    expected_kept = [x for x in signal if x % 3 == 0][:4]
    if len(made) > 2:  # round 2's size follows from round 1's outcome, and is checked the same way
        have = sum(x % 3 == 0 for x in signal)
        r2_rows, r2_idx = ds.round_rows(2, 2, ds.next_round_size(have, 16))
        assert made[2] == r2_idx
        expected_kept = [x for x in signal + [r["id"] for r in r2_rows] if x % 3 == 0][:4]
    assert len(made) <= 3  # max_sampling_rounds
    kept = [g for g in batch.groups if g.dropped is None]
    assert [g.row["id"] for g in kept] == expected_kept
    assert all(g.dropped in (NO_SIGNAL, STEP_FULL) for g in batch.groups if g.dropped)
    m = batch.metrics
    assert m["sampling/rounds"] == len(made) and m["sampling/groups_generated"] == len(batch.groups)
    assert m["sampling/extra_groups"] == len(batch.groups) - 4 and m["sampling/groups_kept"] == len(kept)
    assert m["sampling/groups_short"] == 4 - len(kept)
    # reward figures over every generated group: id%3==0 groups score (1 + 0) / 2 per pair, others 0
    n_signal = sum(g.row["id"] % 3 == 0 for g in batch.groups)
    assert m["reward/mean"] == pytest.approx(0.5 * n_signal / len(batch.groups))
    assert m["gen/completions"] == 4 * len(batch.groups)
