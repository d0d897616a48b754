"""`grpoflow report RUN`: PNG plots and a markdown summary of a run, from the same SQL users run.

Plots: reward curve (valid completions only), invalid rate per reward function, completion length,
step time breakdown. The PNGs are drawn by a small stdlib rasteriser (zlib + struct) rather than
adding a plotting dependency; every plotted series is also written to `report.json`, so the numbers
behind each picture can be checked against SQL.
"""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from pathlib import Path
from typing import Any

from storage.records import validate_run_id
from storage.sql import CANNED, query

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


class Canvas:
    """RGB pixels with lines and rectangles; enough for line and bar charts."""

    def __init__(self, w: int = 640, h: int = 360):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def dot(self, x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i : i + 3] = bytes(c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c, width: int = 2) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for k in range(n + 1):
            x, y = x0 + (x1 - x0) * k / n, y0 + (y1 - y0) * k / n
            for dx in range(width):
                for dy in range(width):
                    self.dot(int(x) + dx, int(y) + dy, c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c) -> None:
        for y in range(min(y0, y1), max(y0, y1)):
            for x in range(x0, x1):
                self.dot(x, y, c)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3 : (y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b"")
        )


M = 40  # margin in pixels


def _frame(cv: Canvas) -> None:
    grey = (120, 120, 120)
    cv.line(M, cv.h - M, cv.w - M, cv.h - M, grey, 1)
    cv.line(M, M, M, cv.h - M, grey, 1)


def line_chart(series: dict[str, list[tuple[float, float]]]) -> bytes:
    cv = Canvas()
    _frame(cv)
    pts = [p for s in series.values() for p in s if p[1] is not None]
    if pts:
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        y0, y1 = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts)
        sx = (cv.w - 2 * M) / ((x1 - x0) or 1)
        sy = (cv.h - 2 * M) / ((y1 - y0) or 1)
        for color, s in zip(COLORS, series.values(), strict=False):
            xy = [(M + (x - x0) * sx, cv.h - M - (y - y0) * sy) for x, y in s if y is not None]
            for (a, b), (c, d) in itertools.pairwise(xy):
                cv.line(a, b, c, d, color)
    return cv.png()


def bar_chart(values: dict[str, float]) -> bytes:
    cv = Canvas()
    _frame(cv)
    top = max([v for v in values.values() if v is not None] + [1e-9])
    n = max(1, len(values))
    width = (cv.w - 2 * M) // n
    for i, (color, v) in enumerate(zip(COLORS * n, values.values(), strict=False)):
        h = int((cv.h - 2 * M) * (v or 0.0) / top)
        cv.rect(M + i * width + 4, cv.h - M - h, M + (i + 1) * width - 4, cv.h - M, color)
    return cv.png()


def report_data(root: str | Path, run_id: str) -> dict[str, Any]:
    """The numbers behind every plot, straight from the canned SQL queries."""
    validate_run_id(run_id)
    _, curve = query(root, CANNED["reward_curve"], {"run": run_id})
    _, invalid = query(root, CANNED["invalid_rate"], {"run": run_id})
    _, lengths = query(root, CANNED["lengths"], {"run": run_id})
    cols, steps = query(root, f"SELECT * FROM steps WHERE run_id = '{run_id}' ORDER BY step")
    timing = [dict(zip(cols, r, strict=True)) for r in steps]
    parts = ["gen_seconds", "score_seconds", "train/seconds", "sync_seconds", "write_seconds"]
    return {
        "reward_curve": [[r[1], r[2]] for r in curve],
        "invalid_rate": {r[1]: r[3] for r in invalid},
        "mean_tokens": [[r[1], r[2]] for r in lengths],
        "step_time": {p: [[t["step"], t.get(p)] for t in timing] for p in parts if timing and p in timing[0]},
    }


def write_report(root: str | Path, run_id: str, out_dir: str | Path | None = None) -> Path:
    data = report_data(root, run_id)
    out = Path(out_dir) if out_dir else Path(root) / "reports" / run_id
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward_curve.png").write_bytes(line_chart({"reward": data["reward_curve"]}))
    (out / "invalid_rate.png").write_bytes(bar_chart(data["invalid_rate"]))
    (out / "completion_length.png").write_bytes(line_chart({"tokens": data["mean_tokens"]}))
    (out / "step_time.png").write_bytes(line_chart(data["step_time"]))
    (out / "report.json").write_text(json.dumps(data, indent=1))
    curve = data["reward_curve"]
    md = [f"# Report `{run_id}`", "", f"Steps: {len(curve)}; reward (valid completions only) "
          f"{curve[0][1] if curve else None} -> {curve[-1][1] if curve else None}.", "",
          "| reward | invalid rate |", "|---|---|"]  # fmt: skip
    md += [f"| {k} | {v:.3f} |" for k, v in data["invalid_rate"].items()]
    md += ["", "![reward](reward_curve.png) ![invalid](invalid_rate.png)",
           "![length](completion_length.png) ![time](step_time.png)", "",
           "Plot colours in step_time.png, in order: " + ", ".join(data["step_time"])]  # fmt: skip
    (out / "report.md").write_text("\n".join(md) + "\n")
    return out


def grpo_report_flow():
    """The `grpo-report` flow (built lazily so this module imports without Prefect's overhead)."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact

    from flows.progress import artifact_key

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
