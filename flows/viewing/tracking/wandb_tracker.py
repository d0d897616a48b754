"""The Weights & Biases tracker: a W&B run under <root>/wandb/<run>, offline by default (wandb imported
only when a run reports to W&B)."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

from grpoflow.flows.config import GRPOConfig


def _new_wandb_id(run_id: str) -> str:
    # Random suffix: a W&B id once used (even by a deleted run, or another store's run of the same
    # name) cannot start a fresh run.
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_id)[:56]}-{secrets.token_hex(4)}"


class WandbTracker:
    """A W&B run under <root>/wandb/<run>, offline unless `tracking.wandb_mode` or $WANDB_MODE say
    otherwise. Where it stands is grpoflow's own cursor in the state (the last step of a session whose
    W&B run finished), as for TensorBoard: a continue is `wandb.init(id=..., resume="allow")` with the
    same id (offline: another `offline-run-*` directory beside the first); `wandb sync
    <root>/wandb/<run>/wandb` uploads every session of it, in order of start time, into the one run.
    wandb's console is off, and `close` ends its service process."""

    name, title, module = "wandb", "W&B", "wandb"

    def __init__(self, cfg: GRPOConfig, run_id: str):
        t = cfg.tracking
        self.run_name = run_id
        self.dir = Path(cfg.storage.root) / "wandb" / run_id
        self.mode = t.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        self.project, self.entity = t.wandb_project, t.wandb_entity
        self.id: str | None = None
        self.run: Any = None
        self.cursor = self._last = -1
        self.new = True

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        self.new = not (state and state.get("id"))
        self.id = _new_wandb_id(self.run_name) if self.new else state["id"]  # type: ignore[index]
        self.cursor = self._last = -1 if self.new else int(state.get("cursor", -1))  # type: ignore[union-attr]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=self.id,
            name=self.run_name,
            dir=str(self.dir),
            mode=self.mode,
            resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )
        return self.flush()

    def logged_through(self) -> int:
        return self.cursor

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.run.tags = tuple(f"{k}={v}"[:64] for k, v in tags.items())  # W&B's tag length limit
        self.run.config.update(tags, allow_val_change=True)  # in full

    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self.run.log(metrics, step=step)
        self._last = step

    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        import wandb

        self.run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def log_images(self, paths: list[Path]) -> None:
        import wandb

        # At the last step (W&B's steps only grow: a later one would hide the next session's steps).
        self.run.log({f"report/{p.stem}": wandb.Image(str(p)) for p in paths}, step=max(self._last, 0))

    def flush(self) -> dict[str, Any]:
        # The cursor stays: until `finish`, W&B keeps what it was given in memory (wandb-core writes its
        # transaction log 32 KiB at a time, and a SIGKILL of the process takes wandb-core and the unwritten
        # rest with it; online, the upload lags too), so a cursor moved here could claim steps a kill loses.
        return {
            "id": self.id,
            "dir": str(self.dir),
            "mode": self.mode,
            "project": self.project,
            "entity": self.entity,
            "cursor": self.cursor,
        }

    def link(self) -> str:
        url = getattr(self.run, "url", None) if self.mode == "online" else None
        return url or str(self.dir / "wandb")

    def close(self) -> dict[str, Any]:
        import wandb

        try:
            if self.run is not None:
                self.run.finish()  # returns once W&B wrote (offline) or uploaded (online) the session
                # The window: a kill from here until the state is saved (or after W&B wrote a full block
                # of a session that never finished) leaves the cursor behind steps W&B holds, and the
                # resume logs them again. That relies on W&B dropping a step at or below the run's last
                # one (a warning, no row): online, a resumed run starts after its server's last step.
                # Offline each session starts at step 0, so the next session's file holds those steps
                # a second time, with the same values (a closed step never changes); nothing is lost.
                self.cursor = self._last
        finally:
            wandb.teardown()  # the wandb-core service would otherwise live as long as the process
        return self.flush()
