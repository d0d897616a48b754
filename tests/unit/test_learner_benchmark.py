"""benchmarks/learner.py on a bare machine: without pydantic, Prefect, pyarrow, Ray, DuckDB, aiohttp
or the `storage` package its config builder falls back to SimpleNamespaces and a tiny random-model
run prints its JSON lines; the fallback carries every config field the learner reads, with the values
the pydantic configs get."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "learner.py"
BLOCKED = ("pydantic", "prefect", "pyarrow", "ray", "duckdb", "aiohttp", "grpoflow.storage")

# Runs in the child: block the modules, build the configs, then run the script's main as a script.
PRELUDE = f"""
import json, runpy, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None
bench = runpy.run_path({str(SCRIPT)!r}, run_name="learner_bench")
learner, algorithm, source = bench["make_configs"](micro_batch_size=4, share_prompt=True, device="cpu")
print(json.dumps({{"source": source, "learner": vars(learner), "algorithm": vars(algorithm)}}), flush=True)
bench["main"](sys.argv[1:])
"""

KEYS = {
    "model", "device", "device_name", "dtype", "configs", "params", "params_non_embedding", "vocab",
    "share_prompt_requested", "share_prompt", "gradient_checkpointing", "skip_zero_advantage",
    "micro_batch_size", "num_iterations", "mini_batches", "micro_batches", "samples",
    "zero_advantage_samples", "prompt_tokens", "completion_tokens", "forwarded_tokens",
    "seconds_per_step", "completion_tokens_per_s", "tokens_per_s", "step_tflop", "achieved_tflops",
    "peak_bf16_tflops", "mfu", "peak_memory_mib", "peak_memory_kind", "lora_rank", "trainable_params",
    "cpu_matmul_tflops", "of_cpu_matmul_rate",
}  # fmt: skip


def _load():
    spec = importlib.util.spec_from_file_location("learner_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_random_model_runs_without_pydantic_prefect_or_pyarrow():
    args = ["--random-model", "tiny", "--device", "cpu", "--repeats", "1", "--prompts", "2", "--group", "2",
            "--prompt-tokens", "6", "10", "--completion-tokens", "4", "8", "--micro-batch", "4",
            "--share-prompt", "on", "off"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    configs, *rows = lines
    assert configs["source"] == "namespace"
    assert configs["learner"]["micro_batch_size"] == 4 and configs["learner"]["share_prompt"] is True
    assert len(rows) == 2  # the baseline and the one variant that turns share_prompt off
    for row in rows:
        assert set(row) == KEYS
        assert row["configs"] == "namespace" and row["model"] == "random:tiny" and row["device"] == "cpu"
        assert row["samples"] == 4 and row["seconds_per_step"] > 0 and row["step_tflop"] > 0
        assert row["mfu"] is None and row["peak_memory_mib"] > 0  # CPU: no MFU; RSS
        # CPU: the step's rate against this CPU's measured matmul rate instead
        assert row["cpu_matmul_tflops"] > 0 and row["of_cpu_matmul_rate"] > 0
    on, off = rows
    assert (on["share_prompt"], off["share_prompt"]) == (True, False)
    # The same samples in this process: each prompt runs once with share_prompt, once per completion
    # (group 2) without.
    samples = _load().random_samples(2048, 2, 2, (6, 10), (4, 8))
    prompts = sum(s.prompt_len for s in samples[::2])
    assert on["forwarded_tokens"] == prompts + on["completion_tokens"]
    assert off["forwarded_tokens"] == 2 * prompts + on["completion_tokens"]


def test_lora_variant_trains_the_adapter_alone_without_pydantic():
    args = ["--random-model", "tiny", "--device", "cpu", "--repeats", "1", "--prompts", "2", "--group", "2",
            "--prompt-tokens", "6", "10", "--completion-tokens", "4", "8", "--lora", "8"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, row = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert row["lora_rank"] == 8 and 0 < row["trainable_params"] < row["params"] / 10


def _config_reads(path: Path, names: tuple[str, ...] = ("learner", "c", "algorithm", "a")) -> set[str]:
    """Attributes the code (not its strings) reads off the names the config objects go by (`names`,
    `self.config`, `self.algorithm`); a caller keeps the config fields among them."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in names) or (
            isinstance(v, ast.Attribute)
            and isinstance(v.value, ast.Name)
            and v.value.id == "self"
            and v.attr in ("config", "algorithm")
        ):
            out.add(node.attr)
    return out


def test_namespace_configs_carry_every_field_the_learner_reads_with_the_pydantic_values():
    pytest.importorskip("pydantic")
    from grpoflow.tasks.config.algorithm import AlgorithmConfig
    from grpoflow.tasks.config.learner import LearnerConfig
    from grpoflow.tasks.config.model import ModelConfig

    bench = _load()
    kw = {"micro_batch_size": 16, "share_prompt": False, "gradient_checkpointing": True, "mini_batches": 2}
    typed = bench.make_configs(**kw, num_iterations=3)
    plain = bench.make_configs(**kw, num_iterations=3, prefer_pydantic=False)
    assert typed[2] == "pydantic" and plain[2] == "namespace"
    learner = REPO / "tasks" / "learner"
    read = _config_reads(learner / "learn.py") | _config_reads(learner / "grpo.py")
    for cls, pydantic_cfg, namespace in ((LearnerConfig, typed[0], plain[0]), (AlgorithmConfig, typed[1], plain[1])):  # fmt: skip
        fields = read & set(cls.model_fields)
        assert len(fields) >= 5, (cls, fields)  # the pattern still finds them
        for field in sorted(fields):
            assert getattr(namespace, field) == getattr(pydantic_cfg, field), field
    # The model section: the learner reads its dtype alone.
    assert _config_reads(learner / "learn.py", ("model",)) & set(ModelConfig.model_fields) == {"dtype"}
    assert vars(bench.model_config("bfloat16", "namespace")) == {"dtype": "bfloat16"}
    assert bench.model_config("bfloat16", "pydantic").dtype == "bfloat16"


def test_flop_count_shares_prompts_and_counts_the_head_on_completion_tokens_only():
    from grpoflow.tasks.learner.learner_api import TrainSample

    bench = _load()
    dims = {"params_non_embedding": 100, "layers": 2, "attn_width": 8, "hidden": 8, "vocab": 50}
    prompt = [1, 2, 3]
    mb = [TrainSample(prompt + [4, 5], 3, [1, 1], [0.0, 0.0], 1.0) for _ in range(2)]
    # share: prompt once (3 tokens, contexts 1+2+3), completions 2 tokens each (contexts 4+5)
    flops, tokens = bench.forward_cost(mb, True, dims)
    assert tokens == 3 + 2 * 2
    assert flops == 2 * 100 * 7 + 4 * 2 * 8 * (6 + 2 * 9) + 2 * 50 * 8 * 4
    # no share: each sample's 5 tokens, contexts 1..5
    flops, tokens = bench.forward_cost(mb, False, dims)
    assert tokens == 10
    assert flops == 2 * 100 * 10 + 4 * 2 * 8 * (2 * 15) + 2 * 50 * 8 * 4
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("NVIDIA H200") == 989.0
    assert bench.peak_tflops("Some Other GPU") is None and bench.peak_tflops(None) is None
