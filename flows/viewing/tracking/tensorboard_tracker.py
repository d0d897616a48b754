"""The TensorBoard tracker: event files under <root>/tensorboard/<run> (torch's SummaryWriter, imported
only when a run reports to TensorBoard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.viewing.tracking.tracker_api import markdown_table


class TensorBoardTracker:
    """Event files under <root>/tensorboard/<run> (torch's SummaryWriter). Scalars are TensorBoard's
    float32 `simple_value`s (the only scalar type its data server plots: the table's float64 values,
    rounded to float32). Where it stands is the cursor kept in the state after each flush; a continue
    writes a purge at cursor + 1 (`purge_step`), so steps a killed process wrote after its last recorded
    flush are hidden and their re-log is what readers show. The config goes in as a `config` text once,
    each session's tags as a `grpoflow` text, sample tables as `samples` markdown texts, and the
    report's PNGs as images at the last step."""

    name, title = "tensorboard", "TensorBoard"
    module = "tensorboard"  # torch's SummaryWriter writes through the `tensorboard` package

    def __init__(self, cfg: GRPOConfig, run_id: str):
        self.logdir = Path(cfg.storage.root) / "tensorboard" / run_id
        self.cursor = -1  # the last step flushed to the event files
        self._last = -1  # the last step logged
        self.new = True
        self.writer: Any = None

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        self.cursor = self._last = int((state or {}).get("cursor", -1))
        self.new = self.cursor < 0  # nothing held yet: the config too is written (again)
        written = self.logdir.is_dir() and any(self.logdir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=self.cursor + 1 if written else None)
        return self._state()

    def _state(self) -> dict[str, Any]:
        return {"logdir": str(self.logdir), "cursor": self.cursor}

    def logged_through(self) -> int:
        return self.cursor

    def log_params(self, params: dict[str, str]) -> None:
        self.writer.add_text(
            "config", markdown_table(["key", "value"], [[k, v] for k, v in params.items()]), 0
        )

    def set_tags(self, tags: dict[str, str]) -> None:
        # One per session, at the last step held when it started (below its purge, so it stays, and never
        # past the run's last step): which flow run went on from where.
        table = markdown_table(["tag", "value"], [[k, v] for k, v in tags.items()])
        self.writer.add_text("grpoflow", table, max(self.cursor, 0))

    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step, walltime=wall_time)
        self._last = step

    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text("samples", markdown_table(columns, rows), step)

    def log_images(self, paths: list[Path]) -> None:
        from matplotlib.image import imread

        for p in paths:
            self.writer.add_image(f"report/{p.stem}", imread(p), max(self._last, 0), dataformats="HWC")

    def flush(self) -> dict[str, Any]:
        self.writer.flush()
        self.cursor = self._last
        return self._state()

    def link(self) -> str:
        return str(self.logdir)

    def close(self) -> dict[str, Any]:
        if self.writer is not None:
            self.writer.close()  # flushes the event files first
            self.cursor = self._last
        return self._state()
