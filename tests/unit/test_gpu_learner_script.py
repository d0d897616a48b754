"""benchmarks/gpu_learner.py's dry run: the GPU machine's script, whole, on the CPU with the tiny shape,
with the modules that machine lacks (Prefect, DuckDB, Ray) blocked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_learner.py"
PRELUDE = """
import runpy, sys
for name in ("prefect", "duckdb", "ray"):
    sys.modules[name] = None
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_dry_run_reports_tests_steps_push_and_profile(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", PRELUDE.format(script=str(SCRIPT)), "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_learner.json").read_text())
    assert data["meta"]["learner_device"] == "cpu" and data["meta"]["torch"]
    assert data["tests"]["returncode"] == 0 and "passed" in data["tests"]["summary"]
    assert "--learner-device" not in data["tests"]["summary"]
    steps = data["steps"]
    assert [(r["mode"], r["gradient_checkpointing"]) for r in steps] == [
        ("full", False), ("full", True), ("lora16", False), ("lora16", True)
    ]  # fmt: skip
    assert all("error" not in r and r["seconds_per_step"] > 0 and r["step_tflop"] > 0 for r in steps)
    assert steps[0]["trainable_params"] == steps[0]["params"] > steps[2]["trainable_params"] > 0
    new, overwrite = data["push"]
    assert new["kind"] == "new file" and overwrite["kind"] == "overwrite" and new["dtype"] == "float32"
    assert new["file_gib"] * 2**30 >= 4 * steps[0]["params"] * 0.99  # every float32 weight, tied ones once
    shares = data["profile"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01) and shares["matmul"] > 0
    table = (out / "gpu_learner.md").read_text()
    assert table.count("| tiny |") == 4 and "Push write" in table and (out / "profile.txt").is_file()
    assert (out / "tests.log").read_text().strip()


def test_a_variant_spec_names_shape_mode_checkpointing_micro_batch_shared_prompt_compile_and_head_chunk():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_learner", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_variant("1.5b:lora16:on:32") == {
        "shape": "1.5b", "lora": 16, "gradient_checkpointing": True, "micro_batch_size": 32, "share_prompt": None,
        "compile": False, "lm_head_chunk": None, "cast_each": False,
    }  # fmt: skip
    assert mod.parse_variant("0.5b:full:off:8:on")["share_prompt"] is True
    assert mod.parse_variant("0.5b:full:off:8:off")["lora"] is None
    assert mod.parse_variant("1.5b:full:off:8:compile") == mod.parse_variant("1.5b:full:off:8") | {
        "compile": True
    }
    assert mod.parse_variant("1.5b:full:off:8:off:compile")["share_prompt"] is False
    assert mod.parse_variant("1.5b:full:off:32:compile:chunk4096") == mod.parse_variant("1.5b:full:off:32") | {
        "compile": True, "lm_head_chunk": 4096
    }  # fmt: skip
    assert mod.parse_variant("1.5b:full:off:8:casteach") == mod.parse_variant("1.5b:full:off:8") | {
        "cast_each": True
    }
