"""`grpoflow report`: every figure is titled, its axes labelled and every series named; the plotted
numbers are the SQL numbers; every PNG is written and decodes."""

from __future__ import annotations

import json

import pytest

from grpoflow.flows.viewing.report import write_report
from grpoflow.flows.viewing.report_data import NO_TOOL_CALLS, STEP_TIME_PARTS, report_data
from grpoflow.flows.viewing.report_figures import FIGURES, figures
from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup, ToolCallRecord
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query

pytestmark = pytest.mark.unit

STEPS = 4


def _completion(step: int, i: int, tools: bool) -> RolloutCompletion:
    n = step + i + 1  # completion tokens
    # reward `acc` failed on sample 2 (so the completion is invalid); `fmt` timed out there at step 1
    # and was invalid there at step 2
    fmt = {1: "timeout", 2: "invalid"}.get(step, "valid") if i == 2 else "valid"
    calls = [ToolCallRecord(0, "calc", "{}", failed=j == 1) for j in range(i)] if tools and step else []
    return RolloutCompletion(
        i, "a" * n, [1] * n, [1] * n, [-1.0] * n, tool_calls=calls, reward=(step + i) / 10,
        reward_valid=i != 2, reward_cells=[
            RewardCell("acc", 1.0 if i != 2 else None, "valid" if i != 2 else "failed"),
            RewardCell("fmt", 1.0 if fmt == "valid" else None, fmt),
        ],
    )  # fmt: skip


def _write_run(root, run_id: str, *, tools: bool, metrics) -> None:
    store = RolloutStore(root)
    for step in range(STEPS):
        g = RolloutGroup(f"g{step}", step, "p", [0], [_completion(step, i, tools) for i in range(3)])
        store.write_rollouts(run_id, step, [g])
        store.write_rewards(run_id, step, [g])
        store.write_step(run_id, step, metrics(step, g))


def _all_metrics(step: int, g: RolloutGroup) -> dict:
    calls = [tc for c in g.completions for tc in c.tool_calls]
    return {
        "gen_seconds": 0.5 + step,
        "score_seconds": 0.2,
        "train/seconds": 1.0,
        "sync_seconds": 0.1 * step,
        "write_seconds": 0.05,
        "prefect_overhead_seconds": 0.3,
        "checkpoint_seconds": 2.0 if step == STEPS - 1 else None,  # NULL: no checkpoint at this step
        "wall_seconds": 2.0 + step,
        "staleness_mean": step / 4,
        "staleness_max": float(min(step, 2)),
        "gen/tool_calls": float(len(calls)),
        "gen/tool_failures": float(sum(tc.failed for tc in calls)),
    }


@pytest.fixture
def finished_run(tmp_path):
    _write_run(tmp_path, "run", tools=True, metrics=_all_metrics)
    return tmp_path


@pytest.fixture
def old_run(tmp_path):
    """No tool calls, and steps rows from before the staleness, Prefect and checkpoint columns."""
    _write_run(tmp_path, "old", tools=False, metrics=lambda step, g: {
        "gen_seconds": 0.5 + step, "train/seconds": 1.0, "sync_seconds": 0.1})  # fmt: skip
    return tmp_path


def _series_artists(ax) -> list:
    return [*ax.lines, *ax.collections, *ax.containers]


def _plotted(ax) -> dict[str, tuple[list, list]]:
    """label -> (x, y) for every line and bar series of one axes."""
    out = {}
    for line in ax.lines:
        out[line.get_label()] = (list(line.get_xdata()), list(line.get_ydata()))
    for bars in ax.containers:
        out[bars.get_label()] = (
            [r.get_x() + r.get_width() / 2 for r in bars],
            [r.get_height() for r in bars],
        )
    return out


def _sql(root, sql: str, run: str = "run") -> list[tuple]:
    return query(root, sql, {"run": run})[1]


def test_every_figure_titled_axes_labelled_series_named(finished_run):
    figs = figures(report_data(finished_run, "run"))
    assert list(figs) == list(FIGURES)
    for name, fig in figs.items():
        assert fig.get_suptitle().strip(), name
        for ax in fig.axes:
            assert ax.get_xlabel() == "step", name
            assert ax.get_ylabel().strip(), name
            labels = [a.get_label() for a in _series_artists(ax)]
            assert labels, f"{name}: an axes with nothing drawn"
            # matplotlib's defaults ("_child0", "_line0", "_nolegend_") start with "_"
            assert all(lb.strip() and not lb.startswith("_") for lb in labels), (name, labels)
            assert ax.get_legend() is not None, name
            assert sorted(ax.get_legend_handles_labels()[1]) == sorted(labels), name
    assert [ax.get_title() for ax in figs["reward_status"].axes] == ["reward `acc`", "reward `fmt`"]


def test_plotted_numbers_equal_sql(finished_run):
    figs = figures(report_data(finished_run, "run"))
    steps = list(range(STEPS))

    reward, valid = (_plotted(ax) for ax in figs["reward"].axes)
    curve = _sql(finished_run, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts "
                 "WHERE run_id = $run GROUP BY step ORDER BY step")  # fmt: skip
    assert reward["reward mean"] == (steps, pytest.approx([r for _, r in curve]))
    assert reward["reward mean"][1][0] == pytest.approx(0.05)  # (0.0 + 0.1) / 2: the failed one is left out
    assert valid["valid fraction"] == (steps, pytest.approx([2 / 3] * STEPS))

    cells = _sql(finished_run, "SELECT reward_name, step, status, count(*) FROM rewards "
                 "WHERE run_id = $run GROUP BY ALL")  # fmt: skip
    n = {(r, s): sum(c for r2, s2, _, c in cells if (r2, s2) == (r, s)) for r, s, _, _ in cells}
    for ax, reward_name in zip(figs["reward_status"].axes, ["acc", "fmt"], strict=True):
        got = _plotted(ax)
        for status in ("invalid", "failed", "timeout"):
            want = [sum(c for r, s, st, c in cells if (r, s, st) == (reward_name, step, status))
                    / n[reward_name, step] for step in steps]  # fmt: skip
            assert got[f"{status} rate"] == (steps, pytest.approx(want)), (reward_name, status)
    assert _plotted(figs["reward_status"].axes[0])["failed rate"][1] == pytest.approx([1 / 3] * STEPS)
    assert _plotted(figs["reward_status"].axes[1])["timeout rate"][1] == pytest.approx([0, 1 / 3, 0, 0])

    calls, rate = (_plotted(ax) for ax in figs["tool_calls"].axes)
    logged = _sql(finished_run, 'SELECT step, "gen/tool_calls", "gen/tool_failures" FROM steps '
                  "WHERE run_id = $run ORDER BY step")  # fmt: skip
    viewed = _sql(finished_run, "SELECT step, count(*), count(*) FILTER (WHERE failed) FROM tool_calls "
                  "WHERE run_id = $run GROUP BY step ORDER BY step")  # fmt: skip
    assert [r[1:] for r in logged] == [(0, 0), (3, 1), (3, 1), (3, 1)]
    assert [(s, c, f) for s, c, f in logged if c] == viewed  # the logged metrics and the view agree
    assert calls["succeeded"] == (steps, [c - f for _, c, f in logged])
    assert calls["failed"] == (steps, [f for _, _, f in logged])
    assert rate["success rate"][1][1:] == pytest.approx([2 / 3] * 3)  # step 0: no calls, no rate

    stale = _plotted(figs["staleness"].axes[0])
    rows = _sql(
        finished_run, "SELECT staleness_mean, staleness_max FROM steps WHERE run_id = $run ORDER BY step"
    )
    assert stale["mean staleness"] == (steps, [r[0] for r in rows])
    assert stale["max staleness"] == (steps, [r[1] for r in rows])

    time = _plotted(figs["step_time"].axes[0])
    assert [b.get_label() for b in figs["step_time"].axes[0].containers] == list(STEP_TIME_PARTS.values())
    for col, label in STEP_TIME_PARTS.items():
        secs = [
            r[0] for r in _sql(finished_run, f'SELECT "{col}" FROM steps WHERE run_id = $run ORDER BY step')
        ]
        assert time[label] == (steps, pytest.approx([v or 0.0 for v in secs])), col
    assert time["checkpoint"][1] == [0.0, 0.0, 0.0, 2.0]
    assert time["step wall time"] == (steps, [2.0, 3.0, 4.0, 5.0])

    length = _plotted(figs["completion_length"].axes[0])
    toks = _sql(finished_run, "SELECT avg(completion_tokens) FROM rollouts WHERE run_id = $run "
                "GROUP BY step ORDER BY step")  # fmt: skip
    assert length["mean completion tokens"] == (steps, pytest.approx([r[0] for r in toks]))


def test_write_report_pngs_json_markdown(finished_run, tmp_path):
    from matplotlib.image import imread

    out = write_report(finished_run, "run", tmp_path / "out")
    md = (out / "report.md").read_text()
    for name in FIGURES:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
        h, w, _ = imread(png).shape
        assert w >= 800 and h >= 400, name
        assert f"({name}.png)" in md, name
    data = json.loads((out / "report.json").read_text())
    curve = _sql(finished_run, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts "
                 "WHERE run_id = $run GROUP BY step ORDER BY step")  # fmt: skip
    assert data["reward_curve"] == [[s, pytest.approx(r)] for s, r in curve]
    assert data["reward_status_totals"]["acc"] == {
        "cells": 12,
        "invalid": 0,
        "failed": pytest.approx(1 / 3),
        "timeout": 0,
    }
    assert data["step_time"]["gen_seconds"] == [[0, 0.5], [1, 1.5], [2, 2.5], [3, 3.5]]
    assert "| acc | 12 | 0.000 | 0.333 | 0.000 |" in md and "Tool calls: 9, 3 failed" in md


def test_run_without_tool_calls_or_newer_columns(old_run, tmp_path):
    data = report_data(old_run, "old")
    figs = figures(data)
    tool_axes = figs["tool_calls"].axes
    assert all(not _series_artists(ax) for ax in tool_axes)
    assert all(NO_TOOL_CALLS in [t.get_text() for t in ax.texts] for ax in tool_axes)
    assert [t.get_text() for t in figs["staleness"].axes[0].texts] == ["no staleness recorded in this run"]
    parts = [b.get_label() for b in figs["step_time"].axes[0].containers]
    assert parts == ["generation", "train", "push"]  # columns the run lacks are skipped
    out = write_report(old_run, "old", tmp_path / "out")
    assert all((out / f"{name}.png").stat().st_size > 10_000 for name in FIGURES)
    assert f"Tool calls: {NO_TOOL_CALLS}." in (out / "report.md").read_text()


def test_held_out_curve_is_drawn_from_the_eval_rows_and_leaves_the_training_curves_alone(tmp_path):
    """run.eval_every writes split='eval' groups into the steps' files: the reward figure draws them as
    their own series, and every training figure and total counts the training rows only."""
    _write_run(tmp_path, "run", tools=True, metrics=_all_metrics)
    store = RolloutStore(tmp_path)
    for step in (1, 3):
        train = store.read_groups("run", step)
        held = RolloutGroup(f"eval-{step}", 0, "q", [0], [_completion(step + 4, i, False) for i in range(3)],
                            split="eval")  # fmt: skip
        store.write_rollouts("run", step, [*train, held])
        store.write_rewards("run", step, [*train, held])
    data = report_data(tmp_path, "run")
    reward, valid = (_plotted(ax) for ax in figures(data)["reward"].axes)
    held = _sql(tmp_path, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts "
                "WHERE run_id = $run AND split = 'eval' GROUP BY step ORDER BY step")  # fmt: skip
    assert reward["held-out eval"] == ([1, 3], pytest.approx([r for _, r in held]))
    assert valid["held-out valid fraction"] == ([1, 3], pytest.approx([2 / 3, 2 / 3]))
    train = _sql(tmp_path, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts "
                 "WHERE run_id = $run AND split = 'train' GROUP BY step ORDER BY step")  # fmt: skip
    assert reward["reward mean"] == (list(range(STEPS)), pytest.approx([r for _, r in train]))
    assert data["reward_status_totals"]["acc"]["cells"] == 3 * STEPS  # the eval cells are not in it
    assert [s for s, _ in data["mean_tokens"]] == list(range(STEPS))
    assert data["mean_tokens"][1][1] == pytest.approx(3.0)  # step 1's training lengths 2, 3, 4
    out = write_report(tmp_path, "run")
    first, last = held[0][1], held[-1][1]
    assert (
        f"Held-out eval reward (the eval split, same rows and seeds each time): {first:.3f} at step 1 -> "
        f"{last:.3f} at step 3" in (out / "report.md").read_text()
    )
