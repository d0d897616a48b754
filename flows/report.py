"""`grpoflow report RUN`: PNG plots and a markdown summary of a run, from the same SQL users run.

Figures (matplotlib, Agg, object API only: no pyplot global state; imported lazily so importing this
module stays cheap), one PNG each, step on the x axis:

- `reward.png`: reward mean (± std) over valid completions, and the valid fraction; with
  `run.eval_every`, the held-out split's (dashed, diamonds) beside them.
- `reward_status.png`: per reward function, its invalid / failed / timeout rates.
- `tool_calls.png`: tool calls (succeeded / failed) and their success rate; a run without tool calls
  still gets the figure, saying so.
- `staleness.png`: mean and max staleness of the step's batch (steps between sampler and learner).
- `step_time.png`: where a step's time goes (generation, scoring, train, push, write, Prefect,
  checkpoint: the `steps` columns a run has), stacked, with the step's wall time over it.
- `completion_length.png`: mean completion tokens, with the min-max band.

`report_data` holds the numbers behind every figure (parameterised SQL over the store's views) and is
written as `report.json`; `figures(data)` draws them; `report.md` embeds every PNG with a summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.sql import CANNED, query

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# steps column -> its name in step_time.png, in stacking order (columns a run lacks are skipped).
# Generation and scoring of later steps run while a step trains, so the stack can exceed wall time.
STEP_TIME_PARTS = {
    "gen_seconds": "generation",
    "score_seconds": "scoring",
    "train/seconds": "train",
    "sync_seconds": "push",
    "write_seconds": "write",
    "prefect_overhead_seconds": "Prefect",
    "checkpoint_seconds": "checkpoint",
}
STATUSES = ("invalid", "failed", "timeout")
# Rates often coincide (all 0): each status its own line style and marker, so none hides another.
_STATUS_STYLE = {"invalid": ("-", "o"), "failed": ("--", "s"), "timeout": (":", "^")}
FIGURES = ("reward", "reward_status", "tool_calls", "staleness", "step_time", "completion_length")
NO_TOOL_CALLS = "no tool calls in this run"

# Per step and reward function: the share of its cells with each non-valid status.
_REWARD_STATUS_SQL = """
    SELECT reward_name, step, count(*) AS cells,
           avg(CASE WHEN status = 'invalid' THEN 1.0 ELSE 0.0 END) AS invalid,
           avg(CASE WHEN status = 'failed' THEN 1.0 ELSE 0.0 END) AS failed,
           avg(CASE WHEN status = 'timeout' THEN 1.0 ELSE 0.0 END) AS timeout
    FROM rewards WHERE run_id = $run AND split = 'train'
    GROUP BY reward_name, step ORDER BY reward_name, step"""

# Per step (every step with rollouts, zero-call steps included): tool calls and failed ones.
_TOOL_CALLS_SQL = """
    SELECT s.step, count(t.name) AS calls, count(*) FILTER (WHERE t.failed) AS failed
    FROM (SELECT DISTINCT step FROM rollouts WHERE run_id = $run AND split = 'train') s
    LEFT JOIN (SELECT * FROM tool_calls WHERE run_id = $run AND split = 'train') t ON t.step = s.step
    GROUP BY s.step ORDER BY s.step"""


def _series(rows: list[tuple], i: int) -> list[list]:
    """[[step, value], ...] from rows whose first column is the step."""
    return [[r[0], r[i]] for r in rows]


def report_data(root: str | Path, run_id: str) -> dict[str, Any]:
    """The numbers behind every figure, from parameterised SQL (the canned queries where they fit).

    Every series is [[step, value], ...]; values may be None (no valid completion at a step, a
    metric a step did not record)."""
    validate_run_id(run_id)
    run = {"run": run_id}
    _, curve = query(root, CANNED["reward_curve"], run)  # run_id, step, mean, std, valid_frac, n
    curve = [r[1:] for r in curve]
    _, held = query(root, CANNED["eval_curve"], run)  # the held-out split (run.eval_every), same columns
    held = [r[1:] for r in held]
    _, totals = query(root, CANNED["invalid_rate"], run)  # run_id, name, cells, rate, inv, fail, tout
    _, per_step = query(root, _REWARD_STATUS_SQL, run)
    _, lengths = query(root, CANNED["lengths"], run)  # run_id, step, mean, min, max, ...
    lengths = [r[1:] for r in lengths]
    _, tools = query(root, _TOOL_CALLS_SQL, run)
    cols, steps = query(root, "SELECT * FROM steps WHERE run_id = $run ORDER BY step", run)
    rows = [dict(zip(cols, r, strict=True)) for r in steps]

    def steps_series(col: str) -> list[list] | None:
        """A steps column as a series; None when the run never recorded it."""
        if not any(r.get(col) is not None for r in rows):
            return None
        return [[r["step"], r.get(col)] for r in rows]

    status: dict[str, dict[str, list[list]]] = {}
    for name, step, _, *rates in per_step:
        for s, rate in zip(STATUSES, rates, strict=True):
            status.setdefault(name, {k: [] for k in STATUSES})[s].append([step, rate])
    optional = {
        k: steps_series(k) for k in ["staleness_mean", "staleness_max", "wall_seconds", *STEP_TIME_PARTS]
    }
    return {
        "reward_curve": _series(curve, 1),
        "reward_std": _series(curve, 2),
        "valid_frac": _series(curve, 3),
        "eval_curve": _series(held, 1),
        "eval_valid_frac": _series(held, 3),
        "reward_status": status,
        "reward_status_totals": {
            r[1]: {"cells": r[2], "invalid": r[4] / r[2], "failed": r[5] / r[2], "timeout": r[6] / r[2]}
            for r in totals
        },
        "tool_calls": _series(tools, 1),
        "tool_failures": _series(tools, 2),
        "tool_success_rate": [[s, (n - f) / n if n else None] for s, n, f in tools],
        "staleness": {k: optional[k] for k in ("staleness_mean", "staleness_max") if optional[k]},
        "step_time": {k: optional[k] for k in STEP_TIME_PARTS if optional[k]},
        "wall_seconds": optional["wall_seconds"] or [],
        "mean_tokens": _series(lengths, 1),
        "min_tokens": _series(lengths, 2),
        "max_tokens": _series(lengths, 3),
    }


# ---------------------------------------------------------------------------------------------
# Figures


def _figure(title: str, panels: int = 1, height: float = 4.5) -> tuple[Figure, list[Axes]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    return fig, list(axes)


def _style(ax: Axes, ylabel: str, title: str = "", reverse: bool = False) -> None:
    """Title, axis labels, integer steps, and the legend outside the axes on the right (`reverse`:
    last series on top, as a stack reads)."""
    from matplotlib.ticker import MaxNLocator

    if title:
        ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(
            loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize="small", reverse=reverse
        )


def _no_data(ax: Axes, text: str, data: dict[str, Any]) -> None:
    """A figure without this kind of data says so, over the run's steps (those with rollouts)."""
    steps = [s for s, _ in data["mean_tokens"]]
    if steps:
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize="large", color="0.4")


def _xy(series: list[list]) -> tuple[list, list]:
    """Steps and values, NaN for a missing value (matplotlib leaves a gap)."""
    return [s for s, _ in series], [float("nan") if v is None else v for _, v in series]


def _bars(series: list[list]) -> dict[str, Any]:
    """Bars with gaps while there are few; touching and not antialiased when there are many, which
    would otherwise alias into stripes."""
    return (
        {"width": 0.8, "linewidth": 0}
        if len(series) <= 60
        else {"width": 1.0, "linewidth": 0, "antialiased": False}
    )


def _marker(series: list[list], marker: str = "o") -> dict[str, Any]:
    """Markers on the points while there are few enough to tell apart."""
    return {"marker": marker, "markersize": 4} if len(series) <= 60 else {}


def reward_figure(data: dict[str, Any]) -> Figure:
    fig, (top, bottom) = _figure("Reward per step (valid completions only)", panels=2, height=6)
    curve = data["reward_curve"]
    steps, mean = _xy(curve)
    _, std = _xy(data["reward_std"])
    top.plot(steps, mean, color="C0", label="reward mean", **_marker(curve))
    top.fill_between(
        steps, [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)],
        color="C0", alpha=0.2, linewidth=0, label="± std",
    )  # fmt: skip
    held = data["eval_curve"]
    if held:  # scored every run.eval_every steps: few points, always marked
        top.plot(*_xy(held), color="C3", linestyle="--", marker="D", markersize=5, label="held-out eval")
        bottom.plot(*_xy(data["eval_valid_frac"]), color="C3", linestyle="--", marker="D", markersize=5,
                    label="held-out valid fraction")  # fmt: skip
    bottom.plot(*_xy(data["valid_frac"]), color="C2", label="valid fraction", **_marker(curve))
    bottom.set_ylim(-0.05, 1.05)
    if not curve:
        _no_data(top, "no training rollouts in this run", data)
    _style(top, "reward", "reward over valid completions")
    _style(bottom, "fraction of completions", "completions with a valid reward")
    return fig


def reward_status_figure(data: dict[str, Any]) -> Figure:
    status = data["reward_status"]
    names = sorted(status) or [""]
    fig, axes = _figure(
        "Reward function outcomes per step", panels=len(names), height=max(4.5, 1.0 + 2.6 * len(names))
    )
    for ax, name in zip(axes, names, strict=True):
        if not name:
            _no_data(ax, "no reward cells in this run", data)
        for i, s in enumerate(STATUSES):
            series = status.get(name, {}).get(s, [])
            if series:
                style, marker = _STATUS_STYLE[s]
                ax.plot(*_xy(series), color=f"C{i + 1}", label=f"{s} rate", linestyle=style,
                        **_marker(series, marker))  # fmt: skip
        ax.set_ylim(-0.05, 1.05)
        _style(ax, "share of cells", f"reward `{name}`" if name else "")
    return fig


def tool_calls_figure(data: dict[str, Any]) -> Figure:
    fig, (top, bottom) = _figure("Tool calls per step", panels=2, height=6)
    calls, failures = data["tool_calls"], data["tool_failures"]
    if not any(n for _, n in calls):
        for ax in (top, bottom):
            _no_data(ax, NO_TOOL_CALLS, data)
    else:
        steps = [s for s, _ in calls]
        failed = [f for _, f in failures]
        ok = [n - f for (_, n), f in zip(calls, failed, strict=True)]
        top.bar(steps, ok, color="C2", label="succeeded", **_bars(calls))
        top.bar(steps, failed, bottom=ok, color="C3", label="failed", **_bars(calls))
        rate = data["tool_success_rate"]
        bottom.plot(*_xy(rate), color="C0", label="success rate", **_marker(rate))
        from matplotlib.ticker import MaxNLocator

        top.yaxis.set_major_locator(MaxNLocator(integer=True))
        bottom.set_ylim(-0.05, 1.05)
    _style(top, "tool calls", "tool calls (stacked: succeeded + failed)")
    _style(bottom, "fraction of calls", "tool-call success rate")
    return fig


def staleness_figure(data: dict[str, Any]) -> Figure:
    fig, (ax,) = _figure("Staleness per step (training steps between sampler and learner policy)")
    labels = {"staleness_mean": "mean staleness", "staleness_max": "max staleness"}
    for i, (col, series) in enumerate(data["staleness"].items()):
        ax.plot(*_xy(series), color=f"C{i}", label=labels[col], **_marker(series))
    if not data["staleness"]:
        _no_data(ax, "no staleness recorded in this run", data)
    ax.set_ylim(bottom=-0.1)
    _style(ax, "staleness (steps)")
    return fig


def step_time_figure(data: dict[str, Any]) -> Figure:
    fig, (ax,) = _figure("Where a step's time goes")
    parts = data["step_time"]
    base: dict[int, float] = {}
    for i, (col, series) in enumerate(parts.items()):
        steps = [s for s, _ in series]
        secs = [v or 0.0 for _, v in series]  # NULL: the step did not do it (no checkpoint, no push)
        ax.bar(steps, secs, bottom=[base.get(s, 0.0) for s in steps], color=f"C{i}",
               label=STEP_TIME_PARTS[col], **_bars(series))  # fmt: skip
        for s, v in zip(steps, secs, strict=True):
            base[s] = base.get(s, 0.0) + v
    wall = data["wall_seconds"]
    if wall:
        ax.plot(*_xy(wall), color="black", label="step wall time", **_marker(wall))
    if not parts:
        _no_data(ax, "no step timings in this run", data)
    _style(ax, "seconds", reverse=True)
    return fig


def completion_length_figure(data: dict[str, Any]) -> Figure:
    fig, (ax,) = _figure("Completion length per step")
    mean = data["mean_tokens"]
    steps, _ = _xy(mean)
    ax.fill_between(steps, _xy(data["min_tokens"])[1], _xy(data["max_tokens"])[1], color="C1", alpha=0.2,
                    linewidth=0, label="min-max")  # fmt: skip
    ax.plot(*_xy(mean), color="C1", label="mean completion tokens", **_marker(mean))
    if not mean:
        _no_data(ax, "no rollouts in this run", data)
    ax.set_ylim(bottom=0)
    _style(ax, "completion tokens")
    return fig


def figures(data: dict[str, Any]) -> dict[str, Figure]:
    """Every figure of the report, by file name (without `.png`)."""
    draw = {
        "reward": reward_figure,
        "reward_status": reward_status_figure,
        "tool_calls": tool_calls_figure,
        "staleness": staleness_figure,
        "step_time": step_time_figure,
        "completion_length": completion_length_figure,
    }
    return {name: draw[name](data) for name in FIGURES}


# ---------------------------------------------------------------------------------------------
# Files


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _markdown(run_id: str, data: dict[str, Any]) -> str:
    curve = [r for _, r in data["reward_curve"]]
    valid = [v for _, v in data["valid_frac"] if v is not None]
    md = [
        f"# Report `{run_id}`",
        "",
        f"Steps: {len(curve)}; reward mean over valid completions {_fmt(curve[0] if curve else None)} "
        f"-> {_fmt(curve[-1] if curve else None)}; valid fraction "
        f"{_fmt(sum(valid) / len(valid) if valid else None)} on average.",
        "",
        *_eval_line(data),
        "![reward](reward.png)",
        "",
        "Reward cells per reward function, whole run:",
        "",
        "| reward | cells | invalid | failed | timeout |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {k} | {t['cells']} | {t['invalid']:.3f} | {t['failed']:.3f} | {t['timeout']:.3f} |"
        for k, t in data["reward_status_totals"].items()
    ]
    md += ["", "![reward status](reward_status.png)", ""]
    calls = sum(n for _, n in data["tool_calls"])
    failed = sum(f for _, f in data["tool_failures"])
    md += [
        f"Tool calls: {calls}, {failed} failed (success rate {(calls - failed) / calls:.3f})."
        if calls
        else f"Tool calls: {NO_TOOL_CALLS}.",
        "",
        "![tool calls](tool_calls.png)",
        "",
    ]
    stale = [v for _, v in data["staleness"].get("staleness_max") or [] if v is not None]
    md += [f"Staleness: max {max(stale):g} steps." if stale else "Staleness: not recorded in this run.", ""]
    md += ["![staleness](staleness.png)", ""]
    totals = {STEP_TIME_PARTS[k]: sum(v or 0.0 for _, v in s) for k, s in data["step_time"].items()}
    if data["wall_seconds"]:
        totals["wall"] = sum(v or 0.0 for _, v in data["wall_seconds"])
    if totals:
        md += [
            "Step time, whole run (seconds; generation and scoring of later steps overlap training, so "
            "the parts can add up to more than the wall time):",
            "",
            "| " + " | ".join(totals) + " |",
            "|" + "---|" * len(totals),
            "| " + " | ".join(f"{v:.1f}" for v in totals.values()) + " |",
            "",
        ]
    md += ["![step time](step_time.png)", "", "![completion length](completion_length.png)"]
    return "\n".join(md) + "\n"


def _eval_line(data: dict[str, Any]) -> list[str]:
    """The held-out curve in words (run.eval_every), or nothing for a run that never scored it."""
    held = [(s, v) for s, v in data["eval_curve"] if v is not None]
    if not held:
        return []
    (s0, first), (s1, last) = held[0], held[-1]
    best = max(held, key=lambda p: p[1])
    return [
        f"Held-out eval reward (the eval split, same rows and seeds each time): {first:.3f} at step {s0} -> "
        f"{last:.3f} at step {s1}, best {best[1]:.3f} at step {best[0]} ({len(held)} evals).",
        "",
    ]


def write_report(root: str | Path, run_id: str, out_dir: str | Path | None = None) -> Path:
    """report.json, one PNG per figure and report.md under `out_dir` (default <root>/reports/<run>)."""
    data = report_data(root, run_id)
    out = Path(out_dir) if out_dir else Path(root) / "reports" / run_id
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in figures(data).items():
        fig.savefig(out / f"{name}.png", format="png")
    (out / "report.json").write_text(json.dumps(data, indent=1))
    (out / "report.md").write_text(_markdown(run_id, data))
    return out


def grpo_report_flow():
    """The `grpo-report` flow (built lazily so this module imports without Prefect's overhead)."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact

    from grpoflow.flows.progress import artifact_key

    @flow(name="grpo-report")
    def grpo_report(run_id: str, root: str = "runs", out_dir: str | None = None) -> str:
        out = write_report(root, run_id, out_dir)
        create_markdown_artifact(
            markdown=(out / "report.md").read_text() + f"\n\nFiles: `{out}`\n",
            key=artifact_key(f"{run_id}-report"),
            description=f"grpoflow report for {run_id}",
        )
        return str(out)

    return grpo_report
