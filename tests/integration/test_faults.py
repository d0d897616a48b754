"""Faults at scale through the real vLLM server and Prefect: misbehaving rewards and tools, and stale
groups under a slow learner. The hung reward, raising reward and flaky tool are real functions (in
examples/), not mocks; only their failures are staged."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.storage.sql import query

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_failing_rewards_and_hanging_tools_run_completes_with_rates(chaos_store):
    from tests.integration.conftest import CHAOS_STEPS

    tmp_path, summary = chaos_store
    steps = CHAOS_STEPS
    assert summary["steps_trained"] == steps

    # every (completion, reward) cell has a status; ~30% of `letters` cells are broken in mixed ways
    _, rows = query(tmp_path, "SELECT reward_name, status, count(*) FROM rewards GROUP BY ALL")
    cells = {(name, status): n for name, status, n in rows}
    total = steps * 8 * 8
    assert sum(n for (name, _), n in cells.items() if name == "letters") == total
    bad = cells.get(("letters", "invalid"), 0) + cells.get(("letters", "failed"), 0)
    per_call = int(0.3 * 64)  # exactly this many broken per batch of 64, whatever the model writes
    assert cells[("letters", "invalid")] == steps * (per_call - per_call // 3)  # None + NaN
    assert cells[("letters", "failed")] == steps * (per_call // 3)  # the string
    assert bad == steps * per_call
    # the optional judge hung on some steps (cut off at 2 s) and raised on others
    assert cells[("judge", "timeout")] == 64 * sum(1 for s in range(steps) if s % 4 == 1)
    assert cells[("judge", "failed")] == 64 * sum(1 for s in range(steps) if s % 4 == 3)

    # the steps table shows the rates, and the learner trained on the valid completions only
    _, srows = query(
        tmp_path,
        'SELECT sum("reward/letters/invalid_rate" + "reward/letters/failed_rate") / count(*), '
        'sum("gen/tool_calls"), sum("gen/tool_failures"), max(wall_seconds), '
        'avg("reward/valid_frac") FROM steps',
    )
    rate, tool_calls, tool_failures, slowest, valid_frac = srows[0]
    assert rate == pytest.approx(bad / total)
    assert valid_frac == pytest.approx(1 - bad / total)
    assert tool_calls > 0 and 0 < tool_failures < tool_calls
    # no step stalls beyond the configured timeouts (tool 1 s x 2 turns, reward 2 s): an hour-long
    # hang would show here as a step of an hour
    assert slowest < 60
    _, trows = query(
        tmp_path,
        "SELECT count(*) FILTER (WHERE error LIKE '%timed out after 1%'), "
        "count(*) FILTER (WHERE error LIKE 'ConnectionError%') FROM tool_calls",
    )
    assert trows[0][0] > 0 and trows[0][1] > 0
    _, mrows = query(
        tmp_path,
        "SELECT count(*) FILTER (WHERE trained), "
        "count(*) FILTER (WHERE drop_reason LIKE 'reward invalid%') FROM rollouts WHERE NOT reward_valid",
    )
    assert mrows[0] == (0, bad)  # invalid rewards never reach the loss, and each says why


@pytest.mark.slow
def test_pushing_every_two_steps_under_a_slow_learner_trains_every_batch(
    tmp_path, vllm_server, tiny_model_dir, prefect_api, monkeypatch
):
    """max_staleness 1, weights pushed every 2 steps, a slow learner (0.5 s extra per train step): the
    batches of steps 2 and 4 start under weights 2 steps old, within the bound max_staleness +
    sync_every - 1 = 2, so every batch is trained; the steps' staleness and the rollouts' column are
    one number (training steps between the generating policy and the trained one)."""
    from grpoflow.flows.training.train import grpo_train

    monkeypatch.setenv("GRPOFLOW_FAULTS", "train:sleep=0.5")
    steps = 6
    cfg = load_config(
        REPO / "configs" / "tiny-letters.yaml",
        [
            f"storage.root={tmp_path}",
            f"model.path={tiny_model_dir}",
            f"inference.url={vllm_server.url}",
            f"run.steps={steps}",
            "run.run_id=stale",
            "algorithm.max_staleness=1",
            "sync.sync_every=2",
        ],
    )
    grpo_train(config=cfg)
    _, rows = query(
        tmp_path,
        'SELECT step, groups_dropped_stale, "train/samples", staleness_max FROM steps ORDER BY step',
    )
    assert [int(n) for _, n, _, _ in rows] == [0] * steps
    assert all(samples > 0 for _, _, samples, _ in rows)
    assert [int(m) for *_, m in rows] == [0, 1, 2, 1, 2, 1]
    _, rrows = query(
        tmp_path,
        "SELECT step, max(staleness), count(*) FILTER (WHERE staleness <> step - policy_version), "
        "count(*) FILTER (WHERE drop_reason LIKE 'stale:%'), min(policy_version) "
        "FROM rollouts GROUP BY step ORDER BY step",
    )
    assert [int(m) for _, m, *_ in rrows] == [0, 1, 2, 1, 2, 1]
    assert all(off == 0 and stale == 0 for _, _, off, stale, _ in rrows)
    assert [int(v) for *_, v in rrows] == [0, 0, 0, 2, 2, 4]  # pushed after steps 1 and 3 only
