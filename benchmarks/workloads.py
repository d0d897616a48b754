"""What benchmarks/vs_trl.py and benchmarks/limits.py share: the two workloads, a timed grpoflow run
that returns its `steps` rows, and small number helpers."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"config": REPO / "configs" / "tiny-letters.yaml", "steps": 10},
    "smollm2": {"config": REPO / "configs" / "smollm2-tools.yaml", "steps": 8},
}


def workload_overrides(name: str, smollm2_dir: str) -> list[str]:
    """Config overrides that turn a shipped config into the benchmark workload."""
    if name == "smollm2":
        # No tools: arithmetic word problems, one turn of at most 32 tokens, so TRL and grpoflow do
        # exactly the same thing (the settings the figures in BENCHMARKS.md were measured with).
        return [
            f"model.path={smollm2_dir}",
            "data.generator=grpoflow.examples.envs:arith_rows",
            "data.generator_kwargs={n: 256, seed: 0}",
            "tools.tools=[]",
            "warmup.steps=0",
            "generation.max_turns=1",
            "generation.max_rollout_tokens=null",
            "generation.max_tokens=32",
            "learner.lr=0.000005",
            "learner.micro_batch_size=8",
            "inference.kv_cache_gb=2",
        ]
    return []


def run_steps(
    config: Path, overrides: list[str], *, url: str, steps: int, staleness: int, run_id: str
) -> tuple[list[dict[str, Any]], float]:
    """`grpo-train` for `steps` steps against the server at `url`: its `steps` rows and wall seconds."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.sql import query

    cfg = load_config(
        config,
        [
            *overrides,
            f"inference.url={url}",
            f"run.steps={steps}",
            f"algorithm.max_staleness={staleness}",
            f"run.run_id={run_id}",
            f"run.checkpoint_every={steps}",
        ],
    )
    t0 = time.perf_counter()
    grpo_train(config=cfg)
    seconds = time.perf_counter() - t0
    cols, rows = query(cfg.storage.root, f"SELECT * FROM steps WHERE run_id = '{run_id}' ORDER BY step")
    return [dict(zip(cols, r, strict=True)) for r in rows], seconds


def med(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rnd(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def prepare(name: str, root: Path, smollm2_dir: str) -> tuple[Path, Path, list[str]] | None:
    """The workload's store root, model dir (the tiny model is built once, seeded) and overrides; None,
    with a note, when the SmolLM2 model is missing."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.runs import prepare_model

    if name == "smollm2" and not (Path(smollm2_dir) / "config.json").is_file():
        print(f"# skipping smollm2: no model at {smollm2_dir} (pass --smollm2 DIR)", flush=True)
        return None
    wroot = root / name
    base = load_config(
        WORKLOADS[name]["config"], [f"storage.root={wroot}", *workload_overrides(name, smollm2_dir)]
    )
    model = prepare_model(base)
    return (
        wroot,
        model,
        [f"storage.root={wroot}", *workload_overrides(name, smollm2_dir), f"model.path={model}"],
    )


def serve(cfg, model: Path, log_path: Path, staleness: int | None = None):
    """The embedded vLLM server for `model`, sized by the config's inference section (with
    `learner.lora`: loading adapters of its rank, as a LoRA run's embedded server does), serving the
    dtype a run's own servers would (`served_dtype`: bf16 for a bf16 learner on a CPU that computes it).
    `staleness`: the runs it serves all run at this `algorithm.max_staleness`, so its OpenMP threads wait
    as such a run's own server's would (`takes_turns`); None: runs of several, and they sleep."""
    from grpoflow.flows.processes.serve import embedded_server
    from grpoflow.flows.processes.vllm_command import served_dtype, takes_turns

    lora = cfg.learner.lora
    return embedded_server(
        str(model),
        max_model_len=cfg.inference.max_model_len,
        kv_cache_gb=cfg.inference.kv_cache_gb,
        log_path=log_path,
        lora_rank=lora.served_rank() if lora else None,
        max_loras=cfg.inference.max_loras,
        dtype=served_dtype(cfg),
        spin=staleness is not None and takes_turns(_at_staleness(cfg, staleness)),
    )


def _at_staleness(cfg, staleness: int):
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"max_staleness": staleness})})
