"""grpo-evaluate: generate + score an eval split with a checkpoint (or the server's current weights).

Eval rollouts are written with `split='eval'` under the run id `<run>-eval` (step = the checkpoint's
step), so they never overwrite training files and `WHERE split = 'eval'` finds them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.utilities.annotations import quote

from flows.config import ConfigError, GRPOConfig, check_imports, load_config
from flows.progress import artifact_key
from flows.runs import confine, load_rows, prepare_model, rollout_job
from flows.serve import inference_server
from storage.checkpoints import CheckpointStore
from storage.records import validate_run_id
from tasks.steps import VersionBox, persist_step, rollout_batch


def _model_for(cfg: GRPOConfig, run_id: str | None, checkpoint: str | None) -> tuple[str, int]:
    if checkpoint:
        p = Path(checkpoint)
        if not (p / "model" / "config.json").is_file():
            raise ConfigError(f"checkpoint: {p} is not a checkpoint dir (no model/config.json)")
        return str(p / "model"), int(CheckpointStore.load_state(p).get("step", 0))
    if run_id:
        latest = CheckpointStore(cfg.storage.root).latest(validate_run_id(run_id))
        if latest is None:
            raise ConfigError(f"run {run_id!r} has no checkpoint under {cfg.storage.root}")
        return str(latest / "model"), int(CheckpointStore.load_state(latest)["step"])
    return str(prepare_model(cfg)), 0


@flow(name="grpo-evaluate", log_prints=True)
def grpo_evaluate(
    config: GRPOConfig | None = None,
    run_id: str | None = None,
    config_file: str | None = None,
    checkpoint: str | None = None,
    prompts: int = 16,
    pass_threshold: float = 1.0,
    greedy: bool = False,
) -> dict[str, Any]:
    """Evaluate `prompts` rows (from the end of the dataset order) and publish pass rate and rewards.

    `config` is the whole config tree; `config_file` (a YAML, as for grpo-train) is used when `config`
    is not given. `greedy`: one completion per prompt at temperature 0, so two checkpoints are
    compared on the same prompts without sampling luck."""
    cfg = config or (load_config(config_file) if config_file else GRPOConfig())
    if greedy:
        greedy_gen = {"temperature": 0.0, "group_size": 1}
        cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update=greedy_gen)})
    check_imports(cfg)
    confine(cfg)
    rows = load_rows(cfg)
    model, step = _model_for(cfg, run_id, checkpoint)
    eval_run = validate_run_id(f"{run_id or cfg.run.run_id or 'base'}-eval")
    with inference_server(cfg.inference, model, cfg.storage.root, f"vllm-{eval_run}") as server:
        url = server.url
        if cfg.inference.url and (checkpoint or run_id):
            # An external server must serve the evaluated weights: push them (pause/reload/resume).
            from transformers import AutoModelForCausalLM

            from tasks.push import push_weights_sync

            weights = AutoModelForCausalLM.from_pretrained(model)
            push_weights_sync(
                weights,
                step,
                url=url,
                root=cfg.storage.root,
                run_id=eval_run,
                sync=cfg.sync.model_copy(update={"keep_last": 1}),
                inference=cfg.inference,
            )
        # Deterministic eval rows: the last `prompts` rows of the dataset, in order.
        cursor = list(range(max(0, len(rows) - prompts), len(rows)))
        job = rollout_job(cfg, url, model, VersionBox(step))
        batch = rollout_batch(step, [rows[i] for i in cursor], cursor, quote(job))
        for g in batch.groups:
            g.split = "eval"
            g.group_id = g.group_id.replace("train-", "eval-")
        persist_step(cfg.storage.root, eval_run, step, quote(batch.groups))
    return _publish(batch.groups, eval_run, step, pass_threshold, cfg.storage.root)


def _publish(groups, eval_run: str, step: int, threshold: float, root: str) -> dict[str, Any]:
    comps = [c for g in groups for c in g.completions]
    valid = [c.reward for c in comps if c.reward_valid]
    result = {
        "eval_run": eval_run,
        "step": step,
        "completions": len(comps),
        "valid_frac": len(valid) / max(1, len(comps)),
        "reward_mean": statistics.fmean(valid) if valid else None,
        "reward_std": statistics.pstdev(valid) if len(valid) > 1 else None,
        "pass_rate": sum(r >= threshold for r in valid) / max(1, len(comps)),
        "pass_threshold": threshold,
    }
    create_table_artifact(table=[result], key=artifact_key(f"{eval_run}-{step}"),
                          description="grpo-evaluate result")  # fmt: skip
    create_markdown_artifact(
        markdown=f"# Evaluation `{eval_run}` at step {step}\n\npass rate **{result['pass_rate']:.3f}** "
        f"(reward >= {threshold}, invalid counts as a fail), mean reward over valid completions "
        f'{result["reward_mean"]}.\n\n```\ngrpoflow sql --root {root} "SELECT * FROM rollouts WHERE '
        f"split = 'eval' AND run_id = '{eval_run}'\"\n```\n",
        description="grpo-evaluate summary",
    )
    print(result)
    return result
