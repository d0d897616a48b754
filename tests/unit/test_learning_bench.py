"""benchmarks/learning.py: the trailing-mean / first-reach arithmetic on hand numbers, and the combine
step on two hand-made legs (a missing leg is named, the table and figure are written)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"
_spec = importlib.util.spec_from_file_location("learning_bench", _PATH)
learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning)

REWARDS = [0.1, 0.3, 0.5, 0.2, 0.4, 0.9, None, 0.6]
WALLS = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0]


def test_trailing_means_use_fewer_steps_at_the_start_and_skip_missing_rewards():
    got = learning.trailing_means(REWARDS)
    want = [0.1, 0.2, 0.3, 0.275, 0.3, 0.46, 0.5, 0.525]  # the last two: 2.0 / 4 and 2.1 / 4
    assert got == pytest.approx(want)
    assert learning.final_mean(REWARDS) == pytest.approx(0.525)


def test_first_reach_is_the_first_step_whose_trailing_mean_reaches_the_target():
    assert learning.first_reach(REWARDS, WALLS, 0.45) == (5, 60.0)
    assert learning.first_reach(REWARDS, WALLS, 0.3) == (2, 30.0)  # equal counts as reached
    assert learning.first_reach(REWARDS, WALLS, 0.6) is None
    assert learning.first_reach(REWARDS, WALLS, None) is None
    # A run reaches its own final mean at its last step at the latest.
    assert learning.first_reach(REWARDS, WALLS, learning.final_mean(REWARDS)) == (7, 80.0)


def _leg(system: str, rewards: list[float], walls: list[float]) -> dict:
    return {
        "system": system,
        "seed": 0,
        "steps": len(rewards),
        "config": "configs/smollm2-demo.yaml",
        "rewards": rewards,
        "wall_seconds": walls,
        "total_wall_seconds": walls[-1],
    }


def test_combine_times_each_leg_against_trls_target(tmp_path, capsys):
    trl = _leg("trl", [0.2, 0.4, 0.6], [10.0, 20.0, 30.0])  # target 0.4, reached at step 2 (30 s)
    s0 = _leg("s0", [0.3, 0.5, 0.5], [5.0, 10.0, 15.0])  # trailing means 0.3, 0.4, 0.433: step 1
    for g in (trl, s0):
        (tmp_path / f"leg-{g['system']}-seed0.json").write_text(json.dumps(g))
    rows = {r["system"]: r for r in learning.summarize(learning.load_legs(tmp_path))}
    assert rows["trl"]["target"] == pytest.approx(0.4)
    assert rows["trl"]["reach"] == (2, 30.0) and rows["trl"]["frac"] == 1.0
    assert rows["s0"]["reach"] == (1, 10.0) and rows["s0"]["frac"] == pytest.approx(1 / 3)

    assert learning.combine(tmp_path) == 0
    out = capsys.readouterr().out
    assert "missing legs s2" in out
    assert "| grpoflow s0 | 0 | 3 | 0.400 | 0.433 | 15 | 10 (step 1) | 0.33 |" in out
    assert (tmp_path / "learning.png").stat().st_size > 0
    assert (tmp_path / "learning.md").read_text().startswith("| system |")


def test_legs_are_timed_against_the_trl_leg_that_reaches_its_own_level_soonest(tmp_path):
    trl = _leg("trl", [0.2, 0.4, 0.6], [10.0, 20.0, 30.0])  # its target 0.4 at 30 s
    trl_bf16 = _leg("trl-bf16", [0.2, 0.3, 0.4], [5.0, 10.0, 15.0])  # target 0.3 at 15 s: the reference
    s0_bf16 = _leg("s0-bf16", [0.3, 0.5, 0.5], [1.0, 2.0, 3.0])  # trailing mean >= 0.3 at step 0
    for g in (trl, trl_bf16, s0_bf16):
        (tmp_path / f"leg-{g['system']}-seed0.json").write_text(json.dumps(g))
    legs = learning.load_legs(tmp_path)
    assert [g["system"] for g in legs] == ["trl", "trl-bf16", "s0-bf16"]
    assert learning.trl_reference(legs, 0)["system"] == "trl-bf16"
    rows = {r["system"]: r for r in learning.summarize(legs)}
    assert rows["trl-bf16"]["frac"] == 1.0 and rows["trl"]["target"] == pytest.approx(0.3)
    assert rows["trl"]["reach"] == (1, 20.0) and rows["trl"]["frac"] == pytest.approx(20 / 15)
    assert rows["s0-bf16"]["reach"] == (0, 1.0) and rows["s0-bf16"]["frac"] == pytest.approx(1 / 15)


def test_the_plot_draws_a_leg_of_every_system(tmp_path):
    for i, system in enumerate(learning.SYSTEMS):
        leg = _leg(system, [0.2, 0.4, 0.1 * i], [1.0, 2.0, 3.0])
        (tmp_path / f"leg-{system}-seed0.json").write_text(json.dumps(leg))
    assert learning.combine(tmp_path) == 0
    assert (tmp_path / "learning.png").stat().st_size > 0
