"""Putting a lineage's policy into the live server: gated promotion, rejection, manual promotion, rollback.

A lineage is a run id (`grpo-retrain` resumes it). Its promoted versions are checkpoints; the promotion
log (storage/promotions.py, the `promotions` SQL view) records every decision and what the server
serves after it. Loading a version into the live server is vLLM's pause(keep) -> reload -> resume, with
the server's whole prefix cache dropped before it resumes (requests in flight are recomputed under the
new weights), so no client, salted or not, reuses KV computed under the old weights.

A LoRA lineage (its run trained an adapter, `learner.lora`) is served by a long-lived server started
on the base model with LoRA enabled, shared by several lineages: a version is then its checkpoint's
`adapter/` dir (the base is the checkpoint's learner.json's `base_model`), and loading it into the
server makes the lineage's own name serve it: the name is an alias in the server, re-pointed at the
adapter loaded under an internal name of its own, so it never answers 404, with no per-step re-reads,
no prefix-cache reset (cached KV is keyed by adapter name and path) and no other lineage touched
(tasks/push/lora_serve.py). Below its first promotion the name serves the base model as an identity adapter.

Order of effects, so that a crash at any point leaves the log true of the server or errs safe: pin the
version, load it into the server, then record the decision (a crash before the record leaves a pinned
checkpoint and a server ahead of the log; the next decision reloads whatever it serves, and
`grpoflow serve --lineage` starts from what the log says).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpoflow.storage.checkpoints import CheckpointNotFoundError, CheckpointStore
from grpoflow.storage.promotions import PromotionError, PromotionLog, pin, unpin, version
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.learner.learner_api import checkpoint_weights


def checkpoint_version(root: str | Path, run_id: str, step: int | None = None) -> dict[str, Any]:
    """The servable version of run `run_id` at checkpoint `step` (default: its latest)."""
    try:
        ckpt, step = CheckpointStore(root).at(run_id, step)
    except CheckpointNotFoundError as e:
        where = f" at step {e.step} (it has {e.steps})" if e.step is not None else f" under {root}"
        raise PromotionError(f"run {run_id!r} has no checkpoint{where}") from None
    return version(run_id, step, str(checkpoint_weights(ckpt).resolve()))


def is_adapter(path: str | None) -> bool:
    """Whether a version's path is a LoRA adapter dir (a LoRA lineage's checkpoint), not a model dir."""
    return path is not None and (Path(path) / "adapter_config.json").is_file()


def base_adapter(root: str | Path, lineage: str, like: str) -> str:
    """The lineage's base model as an adapter (every lora_B zero, shaped like the adapter `like`),
    written once beside its promotion log: what its name serves below its first promotion."""
    from grpoflow.tasks.push.lora_serve import identity_adapter

    return str(identity_adapter(like, PromotionLog(root).lineage_dir(lineage) / "base-adapter"))


def base_version(root: str | Path, run_id: str) -> dict[str, Any] | None:
    """The base model run `run_id` started from (None if the run records none)."""
    meta = RolloutStore(root).read_run_meta(run_id) or {}
    base = meta.get("base_model")
    return version(None, None, str(Path(base).resolve())) if base else None


def lineage_adapter(root: str | Path, lineage: str) -> str | None:
    """The adapter a LoRA lineage's name serves now: its served version's adapter, or the identity
    adapter when it rolled back to its base; None when it has no decision or is not a LoRA lineage."""
    log = PromotionLog(root)
    serving = log.serving(lineage)
    if serving is None or is_adapter(serving["path"]):
        return serving and serving["path"]
    adapters = [r["candidate_path"] for r in log.history(lineage) if is_adapter(r["candidate_path"])]
    return base_adapter(root, lineage, adapters[-1]) if adapters else None


def adapter_base_model(adapter: str) -> str | None:
    """The base model a LoRA checkpoint's adapter goes on (its learner.json's `base_model`)."""
    from grpoflow.tasks.learner.checkpoint_io import learner_info

    return learner_info(Path(adapter).parent).get("base_model")


def serving_version(root: str | Path, lineage: str) -> dict[str, Any] | None:
    """What the lineage's live server should serve now (None: nothing decided yet)."""
    return PromotionLog(root).serving(lineage)


def load_into_server(
    path: str,
    step: int | None,
    *,
    server_url: str,
    root: str | Path,
    lineage: str,
    inference: InferenceConfig | None,
    sync: SyncConfig | None,
) -> float:
    """Load a version into the live server: a model dir through the checkpoint push (its
    `reload_timeout_s`), dropping the server's whole prefix cache; an adapter dir under the lineage's
    name (the module doc). The seconds it took."""
    if is_adapter(path):
        return load_lineage_adapter(
            path, server_url=server_url, lineage=lineage, inference=inference, sync=sync
        )
    from grpoflow.tasks.push.push import load_version, weight_push

    sync = (sync or SyncConfig()).model_copy(update={"backend": "checkpoint"})
    pusher = weight_push(root, lineage, sync, inference or InferenceConfig(), reset_prefix_cache=True)
    return load_version(pusher, server_url, path, step or 0)


def load_lineage_adapter(
    path: str,
    *,
    server_url: str,
    lineage: str,
    inference: InferenceConfig | None,
    sync: SyncConfig | None = None,
) -> float:
    """Make the lineage's name on the server at `server_url` serve the adapter in `path` (sent over the
    network first to a server that cannot read it: `sync.transport`)."""
    import asyncio
    import hashlib
    import time

    from grpoflow.tasks.push.lora_serve import serve_lineage
    from grpoflow.tasks.push.transport import Transport
    from grpoflow.tasks.rollouts.inference import client_for

    transport = Transport(lineage, (sync or SyncConfig()).transport)
    # One name per adapter dir on the server's disk, so a rollback finds it there unchanged; under
    # `<lineage>@lineage/`, which no run's versions (`<run>/v<N>`, run ids have no "@") can be.
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:12]
    remote = f"{lineage}@lineage/adapter-{digest}"

    async def load() -> str:
        async with client_for(server_url, inference or InferenceConfig()) as client:
            sent = await transport.deliver_as(client, path, remote, reuse=True)
            return await serve_lineage(server_url, client, lineage, sent.path)

    t0 = time.perf_counter()
    asyncio.run(load())
    return time.perf_counter() - t0


def _announce(row: dict[str, Any]) -> None:
    """A Prefect event (`grpoflow.policy.<decision>`) and a markdown artifact comparing the two."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.events import emit_event

    from grpoflow.flows.training.progress import artifact_key

    payload = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items()}
    emit_event(
        event=f"grpoflow.policy.{row['decision']}",
        resource={
            "prefect.resource.id": f"grpoflow.lineage.{row['lineage']}",
            "prefect.resource.name": row["lineage"],
        },
        payload=payload,
    )

    def name(run, step) -> str:
        return "base model" if run is None else f"`{run}` step {step}"

    def score(v) -> str:
        return "-" if v is None else f"{v:.4f}"

    create_markdown_artifact(
        key=artifact_key(f"promotion-{row['lineage']}"),
        markdown=(
            f"# Lineage `{row['lineage']}`: {row['decision'].replace('_', ' ')}\n\n{row['reason']}\n\n"
            f"| | version | {row['metric'] or 'score'} |\n|---|---|---|\n"
            f"| candidate | {name(row['candidate_run'], row['candidate_step'])} | {score(row['candidate_score'])} |\n"
            f"| incumbent | {name(row['incumbent_run'], row['incumbent_step'])} | {score(row['incumbent_score'])} |\n\n"
            f"Serving now: {name(row['serving_run'], row['serving_step'])}"
            f"{' on ' + row['server'] if row['server'] else ''}.\n"
        ),
        description=f"grpoflow promotion decision {row['decision_id']}",
    )


def promote(
    root: str | Path,
    lineage: str,
    candidate: dict[str, Any],
    *,
    incumbent: dict[str, Any] | None,
    server_url: str | None,
    inference: InferenceConfig | None = None,
    sync: SyncConfig | None = None,
    reason: str,
    scores: dict[str, Any] | None = None,
    flow_run_id: str | None = None,
) -> dict[str, Any]:
    """Make `candidate` the lineage's served version: pin it, load it into `server_url` (if given),
    record it. `scores`: metric, margin, candidate_score, incumbent_score of a gated decision."""
    log = PromotionLog(root)
    with log.locked(lineage):
        pin(candidate["path"], lineage)
        try:
            if server_url:
                load_into_server(
                    candidate["path"],
                    candidate["step"],
                    server_url=server_url,
                    root=root,
                    lineage=lineage,
                    inference=inference,
                    sync=sync,
                )
        except Exception:
            if candidate not in log.stack(lineage):
                unpin(candidate["path"], lineage)
            raise
        row = log.record(
            lineage,
            "promoted",
            candidate=candidate,
            incumbent=incumbent,
            serving=candidate,
            reason=reason,
            server=server_url,
            flow_run_id=flow_run_id,
            **(scores or {}),
        )
    _announce(row)
    return row


def reject(
    root: str | Path,
    lineage: str,
    candidate: dict[str, Any],
    *,
    incumbent: dict[str, Any],
    server_url: str | None,
    reason: str,
    scores: dict[str, Any],
    flow_run_id: str | None = None,
) -> dict[str, Any]:
    """Record a rejected candidate; the server keeps serving the incumbent (nothing is loaded)."""
    log = PromotionLog(root)
    with log.locked(lineage):
        row = log.record(
            lineage,
            "rejected",
            candidate=candidate,
            incumbent=incumbent,
            serving=incumbent,
            reason=reason,
            server=server_url,
            flow_run_id=flow_run_id,
            **scores,
        )
    _announce(row)
    return row


def rollback(
    root: str | Path,
    lineage: str,
    *,
    server_url: str | None,
    inference: InferenceConfig | None = None,
    sync: SyncConfig | None = None,
    flow_run_id: str | None = None,
) -> dict[str, Any]:
    """Serve the version promoted before the current one (the base model below the first), load it
    into `server_url` (if given) and record it; the version rolled back from is unpinned."""
    log = PromotionLog(root)
    with log.locked(lineage):
        stack = log.stack(lineage)
        if not stack:
            raise PromotionError(f"lineage {lineage!r} has no promoted version to roll back from")
        current = stack.pop()
        if stack:
            target = stack[-1]
        else:
            first = next(r for r in log.history(lineage) if r["decision"] == "promoted")
            if first["incumbent_path"] is None or first["incumbent_run"] is not None:
                raise PromotionError(
                    f"lineage {lineage!r}: nothing below its first promotion to roll back to"
                )
            target = version(None, None, first["incumbent_path"])
        if server_url:
            # A LoRA lineage back at its base: its name serves the base model as an identity adapter.
            path = target["path"]
            if is_adapter(current["path"]) and not is_adapter(path):
                path = base_adapter(root, lineage, current["path"])
            load_into_server(
                path,
                target["step"],
                server_url=server_url,
                root=root,
                lineage=lineage,
                inference=inference,
                sync=sync,
            )
        name = "the base model" if target["run"] is None else f"{target['run']} step {target['step']}"
        row = log.record(
            lineage,
            "rolled_back",
            candidate=current,
            incumbent=target,
            serving=target,
            reason=f"rolled back to {name}",
            server=server_url,
            flow_run_id=flow_run_id,
        )
        if current not in stack:
            unpin(current["path"], lineage)
    _announce(row)
    return row
