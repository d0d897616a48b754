"""grpo-retrain: continue a lineage for N more steps, evaluate it against the served policy, and promote
it into the live server only if it is better.

A lineage is a run id. The first call trains it from the base model; each later call resumes it
(the data source is re-read, so rows added since the last call are in the new epochs) and trains
`extra_steps` more steps. Then the gate: the candidate (the new latest checkpoint) and the incumbent
(the lineage's promoted version, or the base model before any promotion) are evaluated on the same
held-out eval rows with the same seeds, on one evaluation server of their own (embedded, or
`eval_server_url`), never the live one. A LoRA lineage's candidate and incumbent adapters are loaded
side by side under their own names on a server started on the base (the base itself when it is the
incumbent), so no weights are swapped before the decision. The candidate is promoted when its `gate_metric` beats the
incumbent's by more than `gate_margin`: it is loaded into `server_url` (when given) and recorded
(flows/lineage/promote.py); otherwise it is recorded as rejected and the server keeps the incumbent. Each call
is also recorded in `runs/<run>.json` under `retrains`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.lineage.evaluate import adapter_base, eval_rows, evaluate_model, evaluation_config, scores
from grpoflow.flows.lineage.promote import base_version, checkpoint_version, promote, reject, serving_version
from grpoflow.flows.processes.cluster import ray_cluster
from grpoflow.flows.processes.serve import inference_server
from grpoflow.flows.processes.vllm_command import served_dtype
from grpoflow.flows.training.environments import check_run
from grpoflow.flows.training.preflight import confine
from grpoflow.flows.training.train import grpo_train
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.choices import GateMetric
from grpoflow.tasks.push.lora_push import adapter_rank


def gate(candidate: float | None, incumbent: float | None, metric: str, margin: float) -> tuple[bool, str]:
    """(promote?, why): the candidate must have a score and beat the incumbent's by more than `margin`."""
    if candidate is None:
        return False, f"the candidate has no {metric} (no valid eval reward)"
    if incumbent is None:
        return (
            True,
            f"the incumbent has no {metric} (no valid eval reward); the candidate has {candidate:.4f}",
        )
    if candidate > incumbent + margin:
        return True, f"{metric} {candidate:.4f} beats the incumbent's {incumbent:.4f} by more than {margin:g}"
    return (
        False,
        f"{metric} {candidate:.4f} does not beat the incumbent's {incumbent:.4f} by more than {margin:g}",
    )


def _evaluate_both(
    cfg: GRPOConfig, lineage: str, candidate: dict, incumbent: dict, rows: list, eval_server_url: str | None
) -> tuple[list, list]:
    """The candidate's and the incumbent's eval groups, on one evaluation server with the same rows and
    seeds. Model dirs: the server starts on the candidate and the incumbent is loaded after it. LoRA
    adapters: the server starts on the base with LoRA enabled (rank: the larger of the two) and both are
    loaded under their own names, side by side, no weights replaced; a base-model incumbent is the
    server's own model."""
    step, cand, inc = candidate["step"], candidate["path"], incumbent["path"]
    adapter = adapter_base(cfg, cand)
    base, lora = adapter or (cand, None)
    if lora is not None:
        lora = lora.model_copy(update={"rank": max(lora.rank, adapter_rank(inc) or 0)})
    tok = base if lora is not None else None  # an adapter dir holds no tokenizer: the base's
    ray_log = Path(cfg.storage.root) / "logs" / f"ray-{lineage}-gate.log"
    with (
        ray_cluster(cfg.scale, cfg.config_dir, ray_log),  # `executor: ray` rewards score here too
        inference_server(
            cfg.inference,
            base,
            cfg.storage.root,
            f"vllm-{lineage}-gate",
            lora,
            served_dtype(cfg),
        ) as server,
    ):
        # A required reward broken on every completion raises (evaluate_model): the gate decides nothing.
        cand_groups = evaluate_model(
            cfg,
            cand,
            step,
            f"{lineage}-eval",
            rows,
            server.url,
            tokenizer=tok,
            load=eval_server_url is not None or lora is not None,
            what="the gate's evaluation of the candidate",
        )
        # A LoRA lineage's base-model incumbent is what the server itself serves: nothing to load.
        load_inc = lora is None or adapter_rank(inc) is not None
        inc_groups = evaluate_model(
            cfg,
            inc,
            step,
            f"{lineage}-eval-incumbent",
            rows,
            server.url,
            load=load_inc,
            tokenizer=tok,
            what="the gate's evaluation of the incumbent",
        )
    return cand_groups, inc_groups


def _record_retrain(
    store: RolloutStore, lineage: str, steps: range, cand_eval: dict, inc_eval: dict, decision: dict
) -> None:
    """Append this call (the steps it trained, both evaluations, the decision) to the lineage run's
    `retrains` in runs/<run>.json, and mark the run as the lineage's."""
    meta = store.read_run_meta(lineage) or {}
    meta.setdefault("retrains", []).append(
        {
            "at": datetime.now(UTC).isoformat(),
            "from_step": steps.start,
            "to_step": steps.stop - 1,
            "eval": cand_eval,
            "incumbent_eval": inc_eval,
            "decision": decision["decision"],
            "decision_id": decision["decision_id"],
        }
    )
    meta["lineage"] = lineage
    store.write_run_meta(lineage, meta)


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


def _train_more(cfg: GRPOConfig, run_id: str, extra_steps: int) -> tuple[GRPOConfig, range, dict]:
    """Train the lineage's run `extra_steps` past its last checkpoint (from scratch when it has none):
    the config it trained under, the steps it trained and grpo-train's summary."""
    root = cfg.storage.root
    latest = CheckpointStore(root).latest(run_id)
    done = int(CheckpointStore.load_state(latest)["step"]) + 1 if latest is not None else 0
    cfg = cfg.model_copy(deep=True)
    cfg.run.run_id = run_id
    cfg.run.steps = done + extra_steps
    resume = run_id if RolloutStore(root).read_run_meta(run_id) is not None else None
    return cfg, range(done, cfg.run.steps), grpo_train(config=cfg, resume=resume)


def _score_both(
    ecfg: GRPOConfig,
    lineage: str,
    candidate: dict,
    incumbent: dict,
    eval_prompts: int | None,
    eval_server_url: str | None,
    pass_threshold: float,
) -> tuple[dict, dict]:
    """The gate's scores of the candidate and the incumbent on the same eval rows (`ecfg`: the config
    the gate evaluates with)."""
    rows, source = eval_rows(ecfg, eval_prompts)
    if source != "eval":
        print(f"lineage {lineage}: no data.eval_path / data.eval_fraction; the gate evaluates training rows")
    cand_groups, inc_groups = _evaluate_both(ecfg, lineage, candidate, incumbent, rows, eval_server_url)
    return (
        {"rows": source, **scores(cand_groups, pass_threshold)},
        {"rows": source, **scores(inc_groups, pass_threshold)},
    )


@flow(name="grpo-retrain", log_prints=True)
def grpo_retrain(
    lineage: str = "nightly",
    extra_steps: int = 10,
    config: GRPOConfig | None = None,
    config_file: str | None = "configs/tiny-letters.yaml",
    eval_prompts: int | None = None,
    server_url: str | None = None,
    gate_metric: GateMetric = "reward_mean",
    gate_margin: float = 0.0,
    eval_greedy: bool = False,
    eval_server_url: str | None = None,
    pass_threshold: float = 1.0,
) -> dict[str, Any]:
    """`server_url`: the live policy server the promoted weights go into (None: the decision is only
    recorded; `grpoflow serve --lineage` starts from it). `eval_prompts`: at most this many eval rows
    (default: the whole eval split). `eval_greedy`: one greedy completion per row instead of the
    config's seeded group."""
    cfg = config or load_config(config_file)
    # before the store is read: a worker-started run stays inside its allowed roots and servers
    confine(cfg, server_url=server_url, eval_server_url=eval_server_url)
    run_id = validate_run_id(lineage)
    if extra_steps < 1:
        raise ConfigError(f"extra_steps: must be at least 1, got {extra_steps}")
    root = cfg.storage.root
    cfg, steps, summary = _train_more(cfg, run_id, extra_steps)

    candidate = checkpoint_version(root, run_id)
    incumbent = serving_version(root, lineage) or base_version(root, run_id)
    if incumbent is None:
        raise ConfigError(f"lineage {lineage!r}: its run records no base model to compare against")
    ecfg = evaluation_config(cfg, eval_greedy, eval_server_url)
    check_run(ecfg)  # the config as the gate scores with it: an environment's reward included
    cand_eval, inc_eval = _score_both(
        ecfg, lineage, candidate, incumbent, eval_prompts, eval_server_url, pass_threshold
    )
    better, why = gate(cand_eval[gate_metric], inc_eval[gate_metric], gate_metric, gate_margin)
    gate_scores = {
        "metric": gate_metric,
        "margin": gate_margin,
        "candidate_score": cand_eval[gate_metric],
        "incumbent_score": inc_eval[gate_metric],
    }
    decide = promote if better else reject
    decision = decide(
        root,
        lineage,
        candidate,
        incumbent=incumbent,
        server_url=server_url,
        reason=why,
        scores=gate_scores,
        flow_run_id=_flow_run_id(),
        **({"inference": cfg.inference, "sync": cfg.sync} if better else {}),
    )
    print(f"lineage {lineage}: {decision['decision']}: {why}")

    _record_retrain(RolloutStore(root), lineage, steps, cand_eval, inc_eval, decision)
    return {"train": summary, "eval": cand_eval, "incumbent_eval": inc_eval, "decision": decision}
