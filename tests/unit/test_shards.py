"""`make test`'s two shards (tests/shards.py): every test file runs in exactly one, and every
integration file that touches state of the whole machine (Ray, the hosts' namespaces, a scan of the
process table) runs in shard B, where none of them overlaps another."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import shards

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
# What makes a test file touch machine-wide state: a Ray cluster, namespace hosts, a scan of every process.
MACHINE_WIDE = re.compile(
    r"\bray\b|ray_address|hosts_fixture|tests\.hosts|\bprocesses\(\)|\bguarded\(\)|process_iter"
)


def test_every_test_file_runs_in_exactly_one_shard():
    a, b = shards.shards()
    files = {f"tests/integration/{p.name}" for p in (REPO / "tests" / "integration").glob("test_*.py")}
    assert set(a) | set(b) == files | {"tests/unit"}
    assert not set(a) & set(b)


def test_machine_wide_tests_all_run_in_shard_b():
    a, _ = shards.shards()
    touching = [path for path in a if MACHINE_WIDE.search((REPO / path).read_text())]
    assert not touching, f"move to tests/shards.py SHARD_B: {touching}"


def test_a_shard_b_name_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setattr(shards, "SHARD_B", (*shards.SHARD_B, "test_gone.py"))
    with pytest.raises(SystemExit, match="test_gone.py"):
        shards.shards()


def test_shard_a_runs_its_memory_heavy_modules_first():
    a, _ = shards.shards()
    heavy = [shards.memory_heavy(REPO / path) for path in a]
    assert any(heavy) and heavy == sorted(heavy, reverse=True), a
    assert [p for p, h in zip(a, heavy, strict=True) if not h] == sorted(
        p for p, h in zip(a, heavy, strict=True) if not h
    )


def test_shard_b_alone_serves_its_shared_server_eager(tmp_path, monkeypatch):
    monkeypatch.delenv(shards.EAGER_SHARED_SERVER_ENV, raising=False)
    a, b = shards.shard_env("a", tmp_path), shards.shard_env("b", tmp_path)
    assert shards.EAGER_SHARED_SERVER_ENV not in a and b[shards.EAGER_SHARED_SERVER_ENV] == "1"
    assert a["PREFECT_HOME"] != b["PREFECT_HOME"] and Path(a["PREFECT_HOME"]).parent == tmp_path
