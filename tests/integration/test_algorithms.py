"""The algorithm options end to end: several updates per batch, CISPO, leave-one-out baselines and the
sequence-level correction, through the session's real vLLM server, Prefect and the store's SQL."""

from __future__ import annotations

import pytest

from storage.sql import query
from tests.support import tiny_cfg

pytestmark = pytest.mark.integration


def _reward_curve(root) -> list[float]:
    _, rows = query(
        root, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts GROUP BY step ORDER BY step"
    )
    return [r[1] or 0.0 for r in rows]


@pytest.mark.slow
def test_two_passes_per_batch_clip_in_sql_and_still_learn(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    from flows.train import grpo_train

    steps = 10
    sets = {"run.steps": steps, "run.run_id": "two", "algorithm.num_iterations": 2}
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
    from flows.train import grpo_train

    sets = {
        "run.steps": 3,
        "run.run_id": "mix",
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
