"""grpo-evaluate: generate + score the eval split with a checkpoint, a model dir or the base model.

The eval rows are the config's eval split (`data.eval_path` / `data.eval_fraction`, never trained on);
without one, the last `prompts` rows of the dataset (training rows, and the result says so). Each row
keeps its place in the split as its `prompt_index`, and sampling is seeded by (run.seed, prompt_index,
sample), so two models evaluated with one config see identical prompts and sampling.

Evaluation runs on its own embedded vLLM server, or on `server_url` (a server the caller keeps for
evaluation: its weights are replaced), never on the training config's `inference.url`, which may be
the server users are served from. A LoRA run's checkpoint (or a PEFT adapter dir) is evaluated as
its base model with the adapter: its own server starts on the base with LoRA enabled (a caller's
server gets the base's weights first: it may hold a run's last weights, or an adapter merged into them),
the adapter is loaded through the `lora` weight push, and requests name it. Eval rollouts are written with
`split='eval'` under the run id `<run>-eval` (or `eval_run`), step = the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.utilities.annotations import quote

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.processes.cluster import ray_cluster
from grpoflow.flows.processes.serve import inference_server
from grpoflow.flows.processes.vllm_command import served_dtype
from grpoflow.flows.training.data import load_rows, split_rows
from grpoflow.flows.training.environments import check_environment_rows, check_run
from grpoflow.flows.training.preflight import confine
from grpoflow.flows.training.progress import artifact_key
from grpoflow.flows.training.runs import prepare_model, rollout_job
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.ids import validate_run_id
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.learner.learner_api import ADAPTER_DIR, MODEL_DIR, checkpoint_weights
from grpoflow.tasks.push.lora_push import adapter_rank
from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError, broken_rewards
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from grpoflow.tasks.steps import RolloutBatch, RolloutJob, persist, rollout_batch


def model_for(cfg: GRPOConfig, run_id: str | None, checkpoint: str | None) -> tuple[str, int]:
    """(model dir or LoRA adapter dir, step) of `checkpoint` (a checkpoint dir, or a plain model or
    adapter dir: step 0), else of run `run_id`'s latest checkpoint, else of the config's base model
    (step 0)."""
    if checkpoint:
        p = Path(checkpoint)
        for held in (p / MODEL_DIR, p / ADAPTER_DIR):
            if _servable(held):
                return str(held), int(CheckpointStore.load_state(p).get("step", 0))
        if _servable(p):
            return str(p), 0
        raise ConfigError(
            f"checkpoint: {p} is neither a checkpoint dir nor a model or adapter dir (no config.json, "
            "no adapter_config.json)"
        )
    if run_id:
        latest = CheckpointStore(cfg.storage.root).latest(validate_run_id(run_id))
        if latest is None:
            raise ConfigError(f"run {run_id!r} has no checkpoint under {cfg.storage.root}")
        return str(checkpoint_weights(latest)), int(CheckpointStore.load_state(latest)["step"])
    return str(prepare_model(cfg)), 0


def _servable(d: Path) -> bool:
    return (d / "config.json").is_file() or (d / "adapter_config.json").is_file()


def adapter_base(cfg: GRPOConfig, model: str) -> tuple[str, LoraConfig] | None:
    """For a LoRA adapter dir: the base model it goes on (its checkpoint's learner.json, else PEFT's
    `base_model_name_or_path` when that dir exists, else the config's model) and a LoraConfig of its
    rank (for the server); None for a model dir."""
    rank = adapter_rank(model)
    if rank is None:
        return None
    from grpoflow.tasks.learner.checkpoint_io import learner_info

    base = learner_info(Path(model).parent).get("base_model")
    if base is None:
        peft = json.loads((Path(model) / "adapter_config.json").read_text())
        named = peft.get("base_model_name_or_path")
        base = named if named and Path(named).is_dir() else str(prepare_model(cfg))
    return base, LoraConfig(rank=rank)


def eval_rows(cfg: GRPOConfig, prompts: int | None) -> tuple[list[dict[str, Any]], str]:
    """The rows evaluated and where they come from ('eval': the held-out split, at most `prompts` of
    it in its order; 'train': no split is configured, the dataset's last `prompts` (default 16))."""
    rows, held = split_rows(cfg, load_rows(cfg))
    check_environment_rows(cfg, rows + held)
    if held:
        return held[:prompts] if prompts else held, "eval"
    n = prompts or 16
    return rows[-n:], "train"


def evaluation_config(cfg: GRPOConfig, greedy: bool, server_url: str | None) -> GRPOConfig:
    """`cfg` as evaluation runs it: on `server_url` or an embedded server of its own (never the
    training config's `inference.url`), and with `greedy`, one completion per row at temperature 0."""
    # One server: evaluation never runs on the training servers (url, urls) nor starts replicas.
    server = {"url": server_url, "urls": [], "replicas": 1}
    update: dict[str, Any] = {"inference": cfg.inference.model_copy(update=server)}
    if greedy:
        update["generation"] = cfg.generation.model_copy(update={"temperature": 0.0, "group_size": 1})
    return cfg.model_copy(update=update)


def evaluate_model(
    cfg: GRPOConfig,
    model: str,
    step: int,
    eval_run: str,
    rows: list[dict[str, Any]],
    url: str,
    *,
    load: bool,
    tokenizer: str | None = None,
    what: str = "the evaluation",
    on_base: str | None = None,
) -> list:
    """Generate and score `rows` with the model dir or LoRA adapter `model` on the server at `url`
    (first loaded into it when `load`: through the backend that loads what `model` holds), and persist
    them as step `step` of `eval_run` (split 'eval'); the groups. `tokenizer`: default `model`'s.
    `on_base`: an adapter's base model dir, loaded into the server before the adapter, whose LoRA path
    applies the adapter to whatever weights the server holds (a caller's server may hold a run's last
    weights, or an adapter merged into them by `sync.backend: lora_merged`).

    A required reward that failed on every completion is a bug, not a score (it would read as "no valid
    reward", a pass rate of 0): BrokenRewardError names `what`, the reward and its error, once the rows
    are stored for a look."""
    replicas = ReplicaSet([Replica(0, url)], version=step)
    if load:
        from grpoflow.tasks.push.push import load_version, weight_push

        # With `on_base`, the server's weights first: the adapter goes on them.
        loads = [("checkpoint", on_base)] if on_base is not None else []
        loads.append(("checkpoint" if adapter_rank(model) is None else "lora", model))
        for backend, path in loads:
            sync = cfg.sync.model_copy(update={"backend": backend})
            pusher = weight_push(cfg.storage.root, eval_run, sync, cfg.inference)
            load_version(pusher, url, path, step)
        replicas.model_name = pusher.model_name  # an adapter: requests name it
    job = dataclasses.replace(rollout_job(cfg, replicas, tokenizer or model), split="eval")
    batch = rollout_batch(step, rows, list(range(len(rows))), quote(job))
    persist(cfg.storage.root, eval_run, step, quote(batch.groups))
    refuse_broken(cfg, batch.groups, f"{what} (its rows: run {eval_run}, step {step})")
    return batch.groups


def refuse_broken(cfg: GRPOConfig, groups: list, what: str) -> None:
    """Raise BrokenRewardError, naming `what`, each reward and its error, when a required reward failed
    on every completion of `groups`; one that failed on some is data (masked)."""
    if broken := [b for b in broken_rewards(groups, cfg.rewards) if b.required]:
        raise BrokenRewardError(f"{what} is broken: " + "; ".join(b.line() for b in broken))


@flow(name="grpo-evaluate", log_prints=True)
def grpo_evaluate(
    config: GRPOConfig | None = None,
    run_id: str | None = None,
    config_file: str | None = None,
    checkpoint: str | None = None,
    prompts: int | None = None,
    pass_threshold: float = 1.0,
    greedy: bool = False,
    server_url: str | None = None,
    eval_run: str | None = None,
) -> dict[str, Any]:
    """Evaluate the eval split (see the module doc) and publish pass rate and rewards.

    `config` is the whole config tree; `config_file` (a YAML, as for grpo-train) is used when `config`
    is not given. `prompts`: at most this many eval rows (default: all; 16 without an eval split).
    `greedy`: one completion per prompt at temperature 0. `server_url`: evaluate on this server
    (its weights are replaced) instead of an embedded one."""
    cfg = config or (load_config(config_file) if config_file else GRPOConfig())
    confine(cfg, server_url=server_url)
    cfg = evaluation_config(cfg, greedy, server_url)
    check_run(cfg)
    rows, source = eval_rows(cfg, prompts)
    model, step = model_for(cfg, run_id, checkpoint)
    # A LoRA adapter: the server starts on its base (able to load it), and the adapter is always loaded.
    base, lora = adapter_base(cfg, model) or (model, None)
    eval_run = validate_run_id(eval_run or f"{run_id or cfg.run.run_id or 'base'}-eval")
    ray_log = Path(cfg.storage.root) / "logs" / f"ray-{eval_run}.log"
    with (
        ray_cluster(cfg.scale, cfg.config_dir, ray_log),
        inference_server(
            cfg.inference,
            base,
            cfg.storage.root,
            f"vllm-{eval_run}",
            lora,
            served_dtype(cfg),
        ) as server,
    ):
        groups = evaluate_model(
            cfg,
            model,
            step,
            eval_run,
            rows,
            server.url,
            load=server_url is not None or lora is not None,
            tokenizer=base,
            on_base=base if server_url is not None and lora is not None else None,
        )
    return _publish(groups, eval_run, step, pass_threshold, cfg.storage.root, source)


class TrainingEval:
    """`run.eval_every`: the held-out split (at most `run.eval_prompts` rows, in split order) scored after
    every N-th step and the last, on the run's own servers, with grpo-evaluate's seeded sampling (seed
    by row position and sample), so every eval of a run sees the same rows and draws."""

    def __init__(self, cfg: GRPOConfig, job: RolloutJob):
        self.every, self.last = cfg.run.eval_every, cfg.run.steps - 1
        self.rows = eval_rows(cfg, cfg.run.eval_prompts)[0] if self.every else []
        self.job = dataclasses.replace(job, split="eval")

    def due(self, step: int) -> bool:
        return bool(self.every) and ((step + 1) % self.every == 0 or step == self.last)


def eval_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The `eval/` metrics of a held-out batch: its reward/ figures (mean over valid completions, valid
    fraction, per reward function), the pass rate (reward >= 1; an invalid completion fails) and the mean
    completion length (the `rollouts.completion_tokens` column's)."""
    comps = [c for g in batch.groups for c in g.completions]
    s = scores(batch.groups, 1.0)
    return {f"eval/{k}": v for k, v in batch.metrics.items() if k.startswith("reward/")} | {
        "eval/pass_rate": s["pass_rate"],
        "eval/completions": float(len(comps)),
        "eval/completion_tokens": statistics.fmean(len(c.completion_ids) for c in comps) if comps else 0.0,
    }


def scores(groups, threshold: float) -> dict[str, Any]:
    """Mean reward over valid completions, valid fraction and pass rate (invalid counts as a fail)."""
    comps = [c for g in groups for c in g.completions]
    valid = [c.reward for c in comps if c.reward_valid]
    return {
        "completions": len(comps),
        "valid_frac": len(valid) / max(1, len(comps)),
        "reward_mean": statistics.fmean(valid) if valid else None,
        "reward_std": statistics.pstdev(valid) if len(valid) > 1 else None,
        "pass_rate": sum(r >= threshold for r in valid) / max(1, len(comps)),
        "pass_threshold": threshold,
    }


def _publish(groups, eval_run: str, step: int, threshold: float, root: str, source: str) -> dict[str, Any]:
    result = {"eval_run": eval_run, "step": step, "rows": source, **scores(groups, threshold)}
    rows = "held-out eval" if source == "eval" else "training"
    create_table_artifact(
        table=[result], key=artifact_key(f"{eval_run}-{step}"), description="grpo-evaluate result"
    )
    create_markdown_artifact(
        markdown=f"# Evaluation `{eval_run}` at step {step}\n\npass rate **{result['pass_rate']:.3f}** "
        f"(reward >= {threshold}, invalid counts as a fail), mean reward over valid completions "
        f"{result['reward_mean']}, on {rows} rows.\n\n```\ngrpoflow sql --root {root} "
        f"\"SELECT * FROM rollouts WHERE split = 'eval' AND run_id = '{eval_run}'\"\n```\n",
        description="grpo-evaluate summary",
    )
    print(result)
    return result
