"""`grpoflow report`'s figures, drawn from `report_data` (flows/viewing/report_data.py).

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpoflow.flows.viewing.report_data import NO_TOOL_CALLS, STATUSES, STEP_TIME_PARTS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Rates often coincide (all 0): each status its own line style and marker, so none hides another.
_STATUS_STYLE = {"invalid": ("-", "o"), "failed": ("--", "s"), "timeout": (":", "^")}
FIGURES = ("reward", "reward_status", "tool_calls", "staleness", "step_time", "completion_length")


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
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        color="C0",
        alpha=0.2,
        linewidth=0,
        label="± std",
    )
    held = data["eval_curve"]
    if held:  # scored every run.eval_every steps: few points, always marked
        top.plot(*_xy(held), color="C3", linestyle="--", marker="D", markersize=5, label="held-out eval")
        bottom.plot(
            *_xy(data["eval_valid_frac"]),
            color="C3",
            linestyle="--",
            marker="D",
            markersize=5,
            label="held-out valid fraction",
        )
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
                ax.plot(
                    *_xy(series),
                    color=f"C{i + 1}",
                    label=f"{s} rate",
                    linestyle=style,
                    **_marker(series, marker),
                )
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
        ax.bar(
            steps,
            secs,
            bottom=[base.get(s, 0.0) for s in steps],
            color=f"C{i}",
            label=STEP_TIME_PARTS[col],
            **_bars(series),
        )
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
    ax.fill_between(
        steps,
        _xy(data["min_tokens"])[1],
        _xy(data["max_tokens"])[1],
        color="C1",
        alpha=0.2,
        linewidth=0,
        label="min-max",
    )
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
