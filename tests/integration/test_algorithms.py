"""The algorithm options end to end: several updates per batch, CISPO, leave-one-out baselines and the
sequence-level correction, through the session's real vLLM server, Prefect and the store's SQL."""

from __future__ import annotations

import pytest

from grpoflow.storage.sql import query
from tests.support import tiny_cfg

pytestmark = pytest.mark.integration


def _reward_curve(root) -> list[float]:
    _, rows = query(
        root, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts GROUP BY step ORDER BY step"
    )
    return [r[1] or 0.0 for r in rows]


@pytest.mark.slow
def test_two_passes_per_batch_clip_in_sql_and_still_learn(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    from grpoflow.flows.training.train import grpo_train

    # Pinned: seed 0 with run.reproducible: the same bits every run, so the clip and the reward's rise
    # asserted below depend on no timing.
    steps = 10
    sets = {"run.steps": steps, "run.run_id": "two", "algorithm.num_iterations": 2, "run.reproducible": True}
    grpo_train(config=tiny_cfg(tmp_path, tiny_model_dir, vllm_server.url, **sets))
    _, rows = query(
        tmp_path,
        'SELECT "train/optimizer_steps", "train/iter0/ratio_min", "train/iter0/ratio_max", '
        '"train/iter1/ratio_min", "train/iter1/ratio_max", "train/clip_frac_low" + "train/clip_frac_high", '
        '"train/iter1/policy_kl", policy_version FROM steps ORDER BY step',
    )
    assert len(rows) == steps
    assert all(r[0] == 2 for r in rows)  # two optimizer steps per training step
    assert [r[7] for r in rows] == list(range(1, steps + 1))  # versions count training steps
    # A step whose groups all had equal rewards runs no forward and has no ratio (NULL); at least the
    # steps after the reward starts to move have one.
    ran = [r for r in rows if r[1] is not None]
    assert len(ran) >= steps // 2
    assert all(r[1] == r[2] == 1.0 for r in ran)  # the first pass: ratio exactly 1
    assert any(r[3] < 0.8 or r[4] > 1.2 for r in ran)  # the second: the policy moved past the clip range
    assert sum(r[5] for r in ran) > 0 and sum(r[6] for r in ran) > 0
    curve = _reward_curve(tmp_path)
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert last > 0.3 and last > 3 * first, curve


@pytest.mark.slow
def test_cispo_leave_one_out_seq_tis_in_mini_batches(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    # Every new option at once, for 3 steps: each step takes 2 optimizer steps, and the advantages the
    # store holds are the leave-one-out ones: (r - mean of the group's other valid rewards) / (std + 1e-4).
    from grpoflow.flows.training.train import grpo_train

    sets = {
        "run.steps": 3,
        "run.run_id": "mix",
        "run.reproducible": True,  # pinned: seed 0, the same bits every run
        "algorithm.loss_type": "cispo",
        "algorithm.epsilon": 1.0,
        "algorithm.epsilon_high": 3.0,
        "algorithm.baseline": "leave_one_out",
        "algorithm.correction": "seq_tis",
        "learner.mini_batches": 2,
    }
    grpo_train(config=tiny_cfg(tmp_path, tiny_model_dir, vllm_server.url, **sets))
    _, rows = query(tmp_path, 'SELECT "train/optimizer_steps", "train/loss" FROM steps ORDER BY step')
    assert [r[0] for r in rows] == [2, 2, 2]
    _, groups = query(
        tmp_path,
        "SELECT list(reward ORDER BY sample_index), list(advantage ORDER BY sample_index) FROM rollouts "
        "WHERE reward_valid GROUP BY step, group_id HAVING stddev_samp(reward) > 1e-6",
    )
    assert groups  # groups with a reward spread exist at a random start (letters reward ~0.01-0.1)
    for rewards, advantages in groups:
        n, total = len(rewards), sum(rewards)
        std = (sum((r - total / n) ** 2 for r in rewards) / (n - 1)) ** 0.5
        expected = [(r - (total - r) / (n - 1)) / (std + 1e-4) for r in rewards]
        assert advantages == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_dynamic_sampling_and_overlong_filtering_through_the_server(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """DAPO's dynamic sampling with a reward that gives rows whose id is not a multiple of 3 no spread
    (0.0 whatever the model writes): those groups always drop for zero variance, so a step whose own
    rows include one always generates a further round, from the rows (seed, step, round) fix."""
    from grpoflow.flows.training.data import rows_for_step
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.tasks.rollouts.sampling import EXTRA_BASE, MAX_ROUNDS, NO_SIGNAL, STEP_FULL, DynamicSampling

    per_step, steps, rounds = 4, 2, 3
    sets = {
        "run.steps": steps, "run.run_id": "dapo", "run.seed": 3, "data.prompts_per_step": per_step,
        "algorithm.dynamic_sampling": "true", "algorithm.max_sampling_rounds": rounds,
        "algorithm.mask_truncated": "true",
        "rewards": "[{name: third, fn: 'tests.unit.reward_fns:letters_on_every_third_row'}]",
    }  # fmt: skip
    cfg = tiny_cfg(tmp_path, tiny_model_dir, vllm_server.url, **sets)
    grpo_train(config=cfg)
    from grpoflow.flows.training.data import load_rows, split_rows

    rows = split_rows(cfg, load_rows(cfg))[0]  # the training rows, as the run draws from
    ds = DynamicSampling(rows, per_step, cfg.run.seed, rounds)
    _, metrics = query(tmp_path, 'SELECT step, "sampling/rounds", "sampling/groups_generated", '
                                 '"sampling/groups_short", "train/samples" FROM steps ORDER BY step')  # fmt: skip
    _, groups = query(tmp_path, """
        SELECT step, group_id, min(prompt_index), min(row_id), any_value(drop_reason),
               stddev_pop(reward) FILTER (WHERE reward_valid), count(*) FILTER (WHERE trained),
               count(*) FILTER (WHERE truncated AND trained)
        FROM rollouts GROUP BY step, group_id ORDER BY step, min(prompt_index)""")  # fmt: skip
    assert [m[0] for m in metrics] == list(range(steps))
    for step, *figures in metrics:
        n_rounds, generated, short = (int(x) for x in figures[:3])  # the steps table holds float64s
        mine = [g for g in groups if g[0] == step]
        assert len(mine) == generated and 1 <= n_rounds <= rounds
        own, _ = rows_for_step(rows, step, per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        if any(r["id"] % 3 for r in own):  # a group that cannot have signal: a further round, always
            assert n_rounds >= 2
        # the extra groups are the rows (seed, step, round) name, in their own index space
        extra = [g for g in mine if g[2] >= EXTRA_BASE]
        by_round: dict[int, list] = {}
        for g in extra:
            by_round.setdefault((g[2] - EXTRA_BASE) // (per_step * 4) - step * MAX_ROUNDS, []).append(g)
        assert sorted(by_round) == list(range(1, n_rounds))
        for rnd, gs in by_round.items():
            expected = ds.round_rows(step, rnd, len(gs))[0]
            assert [g[3] for g in gs] == [str(r["id"]) for r in expected]
        # which groups train, and why the others do not
        kept = [g for g in mine if not (g[4] or "").startswith("dynamic sampling")]
        assert len(kept) == per_step - short
        assert all(int(g[3]) % 3 == 0 and g[5] > 0 for g in kept)
        assert all(g[5] is None or g[5] <= 1e-6 for g in mine if g[4] == NO_SIGNAL)
        assert all(g[4] == NO_SIGNAL for g in mine if int(g[3]) % 3)
        assert all(g[5] > 0 for g in mine if g[4] == STEP_FULL)
        assert all(g[6] == 0 for g in mine if g not in kept) and all(g[7] == 0 for g in mine)
    _, reasons = query(tmp_path, "SELECT count(*) FROM rollouts WHERE truncated AND reward_valid AND NOT trained "
                                 "AND drop_reason NOT LIKE 'dynamic sampling%' AND drop_reason <> "
                                 "'truncated at the token budget (algorithm.mask_truncated)'")  # fmt: skip
    assert reasons == [(0,)]
