"""`grpoflow report`: the PNGs exist, decode, and the plotted numbers equal the SQL numbers."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from flows.report import write_report
from storage.records import RewardCell, RolloutCompletion, RolloutGroup
from storage.rollouts import RolloutStore
from storage.sql import query

pytestmark = pytest.mark.unit


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, (w, h) = 8, b"", (0, 0)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(tag + body)
        if tag == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        if tag == b"IDAT":
            idat += body
        pos += 12 + n
    return w, h, zlib.decompress(idat)


@pytest.fixture
def finished_run(tmp_path):
    store = RolloutStore(tmp_path)
    for step in range(4):
        comps = [RolloutCompletion(i, "a" * (step + i + 1), [1] * (step + i + 1), [1] * (step + i + 1),
                                   [-1.0] * (step + i + 1), reward=(step + i) / 10, reward_valid=i != 2,
                                   reward_cells=[RewardCell("acc", 1.0, "valid" if i != 2 else "failed")])
                 for i in range(3)]  # fmt: skip
        g = RolloutGroup(f"g{step}", step, "p", [0], comps)
        store.write_rollouts("run", step, [g])
        store.write_rewards("run", step, [g])
        store.write_step("run", step, {"gen_seconds": 0.5 + step, "train/seconds": 1.0, "sync_seconds": 0.1})
    return tmp_path


def test_report_pngs_and_numbers_match_sql(finished_run, tmp_path):
    out = write_report(finished_run, "run", tmp_path / "out")
    for name in ("reward_curve", "invalid_rate", "completion_length", "step_time"):
        w, h, raw = decode_png((out / f"{name}.png").read_bytes())
        assert (w, h) == (640, 360) and len(raw) == h * (1 + 3 * w)
        # something was drawn besides the white background and the grey axes
        assert any(
            raw[i : i + 3] not in (b"\xff\xff\xff", b"\x78\x78\x78") for i in range(1, len(raw) - 3, 3)
        )
    data = json.loads((out / "report.json").read_text())
    _, curve = query(finished_run, "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts "
                     "WHERE run_id = 'run' GROUP BY step ORDER BY step")  # fmt: skip
    assert data["reward_curve"] == [[s, pytest.approx(r)] for s, r in curve]
    assert data["reward_curve"][0][1] == pytest.approx(0.05)  # (0.0 + 0.1) / 2: the failed one is left out
    assert data["invalid_rate"] == {"acc": pytest.approx(1 / 3)}
    assert [t for _, t in data["step_time"]["gen_seconds"]] == [0.5, 1.5, 2.5, 3.5]
    assert "reward_curve.png" in (out / "report.md").read_text()
