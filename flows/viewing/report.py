"""`grpoflow report RUN`: PNG plots and a markdown summary of a run, from the same SQL users run.

`report_data` (flows/viewing/report_data.py) holds the numbers behind every figure (parameterised SQL over the
store's views) and is written as `report.json`; `figures(data)` (flows/viewing/report_figures.py) draws them,
one PNG each; `report.md` embeds every PNG with a summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpoflow.flows.viewing.report_data import NO_TOOL_CALLS, STEP_TIME_PARTS, report_data
from grpoflow.flows.viewing.report_figures import figures


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

    from grpoflow.flows.training.progress import artifact_key

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
