"""What a run shows while it trains: a rich progress bar, Prefect progress/table/markdown artifacts."""

from __future__ import annotations

import contextvars
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.training.runs import RunState
from grpoflow.flows.viewing.tracking import TRACKERS
from grpoflow.tasks.rewards.reward_kwargs import RESERVED_METRICS
from grpoflow.tasks.step_record import StepRecord
from grpoflow.tasks.threads import call_within

PROGRESS_EVERY_S = 2.0  # the progress artifact is updated at most this often, and at the last step
# An artifact call waits this long for the Prefect API (Prefect's client retries a server that does not
# answer for minutes); one that fails or takes longer ends the run's artifacts, never its training.
API_WAIT_S = 20.0

# Columns of the step-metrics table artifact (and of the terminal line), in display order.
TABLE_KEYS = [
    "reward/mean",
    "reward/valid_frac",
    "train/loss",
    "train/grad_norm",
    "staleness_mean",
    "groups_dropped_stale",
    "gen_seconds",
    "train/seconds",
    "sync_seconds",
    "wall_seconds",
    "prefect_overhead_frac",
]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


class StepReporter:
    """A run's progress: the step line (a log line, or a progress bar on a terminal) and the Prefect
    progress artifact (at most every PROGRESS_EVERY_S), shown on a thread of their own: the artifact is
    an API call and the line a rich console render, milliseconds each that the training loop does not
    wait for. `finish` waits for them, then writes the step table and the summary."""

    def __init__(self, cfg: GRPOConfig, run: RunState):
        self.cfg, self.run = cfg, run
        self._shows = ThreadPoolExecutor(1, thread_name_prefix="step-report")
        self._progress_at = -math.inf  # when the progress artifact was last updated
        self.rows: list[dict[str, Any]] = []
        self.total = cfg.run.steps
        self.log = get_run_logger()
        self.api_down: str | None = None  # why the run stopped writing artifacts
        self.progress_id = self._api(
            create_progress_artifact,
            progress=100.0 * run.start_step / self.total,
            key=artifact_key(f"{run.run_id}-progress"),
            description=f"grpo-train {run.run_id}: steps done",
        )
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.bar.start()
            self.task = self.bar.add_task(run.run_id, total=self.total, completed=run.start_step, info="")

    def step(self, record: StepRecord) -> None:
        m = record.row()
        row = {"step": record.step} | {k: _num(m.get(k)) for k in TABLE_KEYS}
        self.rows.append(row)
        self._shows.submit(
            contextvars.copy_context().run, self._show, record.step, row, self.line(m)
        )  # in this flow run

    def line(self, m: dict[str, Any]) -> str:
        """The step's figures on the step line: reward, loss (or "nothing trained"), the rewards that
        failed and how often, what reward functions logged (log_metric), seconds per step."""
        reward, loss = _num(m.get("reward/mean")), _num(m.get("train/loss"))
        parts = [f"reward {reward:.3f}" if reward is not None else "reward n/a"]
        parts.append(f"loss {loss:.4f}" if m.get("train/samples") and loss is not None else "nothing trained")
        failed, logged = [], []
        for spec in self.cfg.rewards:
            p = f"reward/{spec.name}/"
            share = (_num(m.get(p + "failed_rate")) or 0.0) + (_num(m.get(p + "timeout_rate")) or 0.0)
            if share:
                failed.append(f"{spec.name} {share:.0%}")
            logged += [
                f"{k[len('reward/') :]} {v:.4g}"
                for k, v in sorted(m.items())
                if k.startswith(p) and k[len(p) :] not in RESERVED_METRICS and _num(v) is not None
            ]
        if failed:
            parts.append("failed: " + ", ".join(failed))
        parts += logged
        return "  ".join([*parts, f"{_num(m.get('wall_seconds')) or 0:.1f}s/step"])

    def _show(self, step: int, row: dict[str, Any], info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, info=info)
        else:
            self.log.info("step %d/%d  %s", step + 1, self.total, info)
        now = time.monotonic()
        if now - self._progress_at < PROGRESS_EVERY_S and step + 1 < self.total:
            return  # an API call per short step costs the API server more than the bar is worth
        self._progress_at = now
        if self.progress_id is not None:
            self._api(update_progress_artifact, self.progress_id, progress=100.0 * (step + 1) / self.total)

    def _api(self, fn, /, *args: Any, **kwargs: Any) -> Any:
        """An artifact call (in this flow run's context), waited for at most API_WAIT_S; once one fails or
        times out the run makes no more (a Prefect API that stopped answering: the steps go to the store
        as ever, and the run does not wait on the UI)."""
        if self.api_down is not None:
            return None
        try:
            return call_within(API_WAIT_S, fn, *args, **kwargs)
        except Exception as e:
            self.api_down = f"{type(e).__name__}: {e}"
            self.log.warning("the Prefect API took no artifact (%s); this run writes no more", self.api_down)
            return None

    def flush(self) -> None:
        """Wait until every step line submitted so far is shown."""
        self._shows.submit(lambda: None).result()

    def finish(self, links: dict[str, str] | None = None) -> None:
        """Show what is left, then write the step table and the summary (with `links`: tracker name ->
        where its tracking run is)."""
        self._shows.shutdown(wait=True)
        if self.bar is not None:
            self.bar.stop()
        if self.rows:
            self._api(
                create_table_artifact,
                table=self.rows,
                key=artifact_key(f"{self.run.run_id}-steps"),
                description=f"Step metrics of {self.run.run_id}",
            )
        self._api(
            create_markdown_artifact,
            markdown=self.markdown(links or {}),
            key=artifact_key(f"{self.run.run_id}-summary"),
            description="Run summary",
        )

    def summary(self) -> dict[str, Any]:
        rewards = [r["reward/mean"] for r in self.rows if r["reward/mean"] is not None]
        return {
            "run_id": self.run.run_id,
            "steps_trained": len(self.rows),
            "first_reward": rewards[0] if rewards else None,
            "last_reward": rewards[-1] if rewards else None,
            "store": str(Path(self.cfg.storage.root).resolve()),
        }

    def markdown(self, links: dict[str, str] | None = None) -> str:
        s = self.summary()
        root = s["store"]
        tracked = "".join(f"- {TRACKERS[k].title}: {_link(v)}\n" for k, v in (links or {}).items())
        if tracked:
            tracked = f"\nTracking runs (steps up to the last checkpoint):\n\n{tracked}"
        return f"""# grpo-train `{self.run.run_id}`

Trained steps {self.run.start_step}..{self.run.start_step + len(self.rows) - 1}; reward (valid completions
only) went from **{s["first_reward"]}** to **{s["last_reward"]}**.
{tracked}
Rollouts, rewards and step metrics are Parquet files under `{root}`:

```
grpoflow sql --root {root} --canned reward_curve --run {self.run.run_id}
grpoflow sql --root {root} "SELECT step, avg(reward) FILTER (reward_valid) AS reward, avg(completion_tokens)
    FROM rollouts WHERE run_id = '{self.run.run_id}' AND split = 'train' GROUP BY step ORDER BY step"
grpoflow sql --root {root} "SELECT reward_name, status, count(*) FROM rewards GROUP BY ALL"
```
"""


def _link(where: str) -> str:
    """A URL as a markdown link; a directory as code."""
    return f"[{where}]({where})" if where.startswith(("http://", "https://")) else f"`{where}`"


def artifact_key(s: str) -> str:
    # Prefect artifact keys: lowercase letters, numbers and dashes only.
    return "".join(ch if ch.isalnum() else "-" for ch in s.lower())
