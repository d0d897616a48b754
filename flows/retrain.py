"""grpo-retrain: continue a lineage from its latest checkpoint for N more steps, then evaluate.

A lineage is a run id. The first call trains it from the base model; each later call resumes it
(the data source is re-read, so rows added since the last call are in the new epochs), trains
`extra_steps` more steps and evaluates. Each call is recorded in `runs/<run>.json` under `retrains`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow

from flows.config import GRPOConfig, load_config
from flows.evaluate import grpo_evaluate
from flows.runs import confine
from flows.train import grpo_train
from storage.checkpoints import CheckpointStore
from storage.records import validate_run_id
from storage.rollouts import RolloutStore


@flow(name="grpo-retrain", log_prints=True)
def grpo_retrain(
    lineage: str = "nightly",
    extra_steps: int = 10,
    config: GRPOConfig | None = None,
    config_file: str | None = "configs/tiny-letters.yaml",
    eval_prompts: int = 16,
) -> dict[str, Any]:
    cfg = config or load_config(config_file)
    confine(cfg)  # before the store is read: a worker-started run stays inside its allowed roots
    run_id = validate_run_id(lineage)
    store = RolloutStore(cfg.storage.root)
    latest = CheckpointStore(cfg.storage.root).latest(run_id)
    done = int(CheckpointStore.load_state(latest)["step"]) + 1 if latest is not None else 0
    cfg = cfg.model_copy(deep=True)
    cfg.run.run_id = run_id
    cfg.run.steps = done + extra_steps
    resume = run_id if store.read_run_meta(run_id) is not None else None
    summary = grpo_train(config=cfg, resume=resume)
    evaluation = grpo_evaluate(config=cfg, run_id=run_id, prompts=eval_prompts)
    meta = store.read_run_meta(run_id) or {}
    meta.setdefault("retrains", []).append(
        {
            "at": datetime.now(UTC).isoformat(),
            "from_step": done,
            "to_step": cfg.run.steps - 1,
            "eval": evaluation,
        }
    )
    meta["lineage"] = lineage
    store.write_run_meta(run_id, meta)
    return {"train": summary, "eval": evaluation}
