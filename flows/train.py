"""grpo-train: the pipelined async GRPO loop (docs/architecture.md, section 2).

Generation + scoring of step s+k runs while step s trains (k = max_staleness); weights are pushed
into the running vLLM server every `sync_every` steps; rollouts, rewards and a steps row land in
Parquet every step; checkpoints make the run resumable.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext
from prefect.utilities.annotations import quote

from flows.config import GRPOConfig, load_config
from flows.progress import StepReporter
from flows.runs import RunState, open_run, preflight, prepare_model, rows_for_step, write_meta
from storage.processes import identity
from storage.rollouts import RolloutStore
from tasks.learn import Learner
from tasks.score import RewardSpec
from tasks.steps import (
    VersionBox,
    assign_advantages,
    persist_step,
    push_weights,
    rollout_batch,
    save_checkpoint,
    train_on_batch,
)


@dataclass
class Server:
    url: str
    handle: Any = None  # flows.serve.ServerHandle for an embedded server; None for an external URL


@contextmanager
def inference_server(cfg: GRPOConfig, run: RunState):
    """The configured server URL, or an embedded vLLM server for this run (always stopped)."""
    from storage.processes import stop_stale

    stop_stale(Path(cfg.storage.root), f"vllm-{run.run_id}")  # one a dead attempt of this run left
    if cfg.inference.url:
        yield Server(cfg.inference.url)
        return
    from flows.serve import embedded_server

    log = Path(cfg.storage.root) / "logs" / f"{run.run_id}-vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with embedded_server(
        run.model_path,
        host=cfg.inference.host,
        port=cfg.inference.port,
        max_model_len=cfg.inference.max_model_len,
        kv_cache_gb=cfg.inference.kv_cache_gb,
        api_key=cfg.inference.api_key,
        extra_args=tuple(cfg.inference.extra_args),
        log_path=log,
        startup_timeout_s=cfg.inference.startup_timeout_s,
        pid_file=(Path(cfg.storage.root), f"vllm-{run.run_id}"),  # a dead attempt's server is stopped
    ) as handle:
        yield Server(handle.url, handle)


def build_learner(cfg: GRPOConfig, run: RunState) -> Learner:
    a, lc = cfg.algorithm, cfg.learner
    learner = Learner(
        run.model_path,
        lr=lc.lr,
        total_steps=cfg.run.steps,
        device=lc.device,
        dtype=cfg.model.dtype,
        weight_decay=lc.weight_decay,
        warmup_steps=lc.warmup_steps,
        lr_schedule=lc.lr_schedule,
        micro_batch_size=lc.micro_batch_size,
        max_grad_norm=lc.max_grad_norm,
        gradient_checkpointing=lc.gradient_checkpointing,
        temperature=cfg.generation.temperature,
        loss_type=a.loss_type,
        epsilon=a.epsilon,
        epsilon_high=a.epsilon_high,
        beta=a.beta,
        correction=a.correction,
        correction_cap=a.correction_cap,
        max_completion_length=cfg.generation.max_rollout_tokens or cfg.generation.max_tokens,
        seed=cfg.run.seed,
        torch_threads=lc.torch_threads,
        share_prompt=lc.share_prompt,
        ref_model_path=run.base_model,
        tokenizer_path=run.base_model,
    )
    if run.checkpoint is not None:
        learner.load_trainer_state(run.checkpoint)
    return learner


def rollout_kwargs(cfg: GRPOConfig, url: str, tokenizer_path: str, versions: VersionBox) -> dict[str, Any]:
    g, t = cfg.generation, cfg.tools
    return dict(
        url=url,
        tokenizer_path=tokenizer_path,
        gen=dict(
            group_size=g.group_size,
            max_tokens=g.max_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            seed=cfg.run.seed,
            max_turns=g.max_turns,
            max_rollout_tokens=g.max_rollout_tokens,
            max_in_flight=g.max_in_flight,
        ),
        tools=dict(
            tool_paths=t.tools,
            environment_path=t.environment,
            env_slots=t.env_slots,
            tool_timeout_s=t.tool_timeout_s,
        ),
        reward_specs=[
            RewardSpec(
                name=r.name,
                fn=r.fn,
                weight=r.weight,
                timeout_s=r.timeout_s,
                executor=r.executor,
                required=r.required,
                kwargs=r.kwargs,
            )
            for r in cfg.rewards
        ],
        versions=quote(versions),
        client_kwargs=client_kwargs(cfg),
    )


def client_kwargs(cfg: GRPOConfig) -> dict[str, Any]:
    i = cfg.inference
    return dict(
        api_key=i.api_key,
        retries=i.retries,
        request_timeout_s=i.request_timeout_s,
        max_in_flight=cfg.generation.max_in_flight,
    )


class RolloutPipeline:
    """Generation + scoring of future steps, submitted up to `max_staleness` ahead of training.

    If the embedded vLLM server dies, its batches fail with InferenceUnavailableError once the client's
    retries run out: the server is restarted (bounded), brought back to the learner's current weights,
    and the lost batches are generated again. An external server is someone else's to restart.
    """

    def __init__(
        self, cfg: GRPOConfig, rows, server: Server, roll_kw: dict, restore_weights, first_step: int
    ):
        self.cfg, self.rows, self.server, self.roll_kw = cfg, rows, server, roll_kw
        self.restore_weights = restore_weights
        self.ahead: deque = deque()
        self.next_step = first_step
        self.restarts = 0

    def _submit(self, step: int) -> tuple[float, Any, int]:
        d = self.cfg.data
        batch_rows, cursor = rows_for_step(self.rows, step, d.prompts_per_step, seed=self.cfg.run.seed,
                                           shuffle=d.shuffle)  # fmt: skip
        return time.perf_counter(), rollout_batch.submit(step, batch_rows, cursor, **self.roll_kw), step

    def fill(self, step: int) -> None:
        while (
            self.next_step < self.cfg.run.steps and self.next_step <= step + self.cfg.algorithm.max_staleness
        ):
            self.ahead.append(self._submit(self.next_step))
            self.next_step += 1

    def next_batch(self):
        """(batch, submit time) of the oldest step; recovers from a dead embedded server."""
        from tasks.inference import InferenceUnavailableError

        while True:
            t_submit, future, _ = self.ahead[0]
            try:
                batch = future.result()
            except InferenceUnavailableError as e:
                self.recover(e)
                continue
            self.ahead.popleft()
            return batch, t_submit

    def recover(self, error: Exception) -> None:
        handle, limit = self.server.handle, 3
        if handle is None or self.restarts >= limit:
            why = "external server" if handle is None else f"restarted {self.restarts} times already"
            raise RuntimeError(f"vLLM server unavailable ({why}); the run is resumable: {error}") from error
        if not (handle.alive() and handle.healthy()):
            get_run_logger().warning("vLLM server down (%s); restarting it", error)
            handle.restart()
        self.restarts += 1
        self.restore_weights()
        # Every in-flight batch may have died with the server: generate them again under new futures.
        self.ahead = deque(self._submit(step) for _, _, step in self.ahead)


def mark_cancelled(flow, flow_run, state) -> None:
    """Prefect's on_cancellation hook. It may run in the worker, after the flow's process was killed:
    the run is found by its flow run id, marked `cancelled`, and its embedded server (if that process
    left one) is stopped. `--resume RUN` continues it."""
    from storage.processes import stop_stale

    params = flow_run.parameters or {}
    cfg = params.get("config")
    if cfg is None and params.get("config_file"):
        cfg = load_config(params["config_file"]).model_dump()
    root = Path(((cfg or {}).get("storage") or {}).get("root") or "runs")
    store = RolloutStore(root)
    for run_id in store.runs():
        meta = store.read_run_meta(run_id) or {}
        if str(flow_run.id) in meta.get("flow_runs", []) and meta.get("status") == "running":
            store.write_run_meta(run_id, {**meta, "status": "cancelled", "error": f"cancelled: {state.name}"})
            stop_stale(root, f"vllm-{run_id}")


@flow(name="grpo-train", log_prints=True, on_cancellation=[mark_cancelled])
def grpo_train(
    config: GRPOConfig | None = None, resume: str | None = None, config_file: str | None = None
) -> dict[str, Any]:
    """Train a policy with async GRPO; `resume` continues a run from its latest checkpoint.

    `config` is the whole config tree (the Prefect UI renders it as a form); `config_file` (a shipped
    YAML, e.g. configs/tiny-letters.yaml) is used when `config` is not given.
    """
    cfg = config or (load_config(config_file) if config_file else GRPOConfig())
    rows = preflight(cfg, resume)  # bad input fails here, before any model is loaded or file written
    base = prepare_model(cfg)
    run = open_run(cfg, resume, base)
    flow_run = FlowRunContext.get()
    write_meta(
        cfg,
        run,
        "running",
        flow_run_id=str(flow_run.flow_run.id) if flow_run else None,
        owner=identity(),  # host + pid + start time: `grpoflow runs` tells a dead owner from a live one
    )
    try:
        summary = _train(cfg, run, rows)
    except BaseException as e:
        write_meta(cfg, run, "failed" if isinstance(e, Exception) else "cancelled", error=repr(e)[:500])
        raise
    write_meta(cfg, run, "completed", last_step=cfg.run.steps - 1)
    return summary


def _train(cfg: GRPOConfig, run: RunState, rows: list[dict]) -> dict[str, Any]:
    root, a, steps = cfg.storage.root, cfg.algorithm, cfg.run.steps
    store = RolloutStore(Path(root))
    reporter = StepReporter(cfg, run)
    versions = VersionBox(run.policy_version)
    with inference_server(cfg, run) as server:
        url = server.url
        learner = build_learner(cfg, run)
        push_kw = dict(
            url=url,
            root=root,
            run_id=run.run_id,
            keep_last=cfg.sync.keep_last,
            reload_timeout_s=cfg.sync.reload_timeout_s,
            client_kwargs=client_kwargs(cfg),
        )
        if run.resumed or cfg.inference.url:  # the server must serve exactly the learner's weights
            push_weights(quote(learner), version=versions.get(), **push_kw)
        roll_kw = rollout_kwargs(cfg, url, run.base_model, versions)
        trained = [run.policy_version]  # optimizer updates in the learner's weights: their version

        def restore_weights() -> None:  # a restarted server gets the learner's weights as they are now
            push_weights(quote(learner), version=trained[0], versions=quote(versions), **push_kw)

        pipeline = RolloutPipeline(cfg, rows, server, roll_kw, restore_weights, run.start_step)

        def push(version: int) -> dict:
            from tasks.inference import InferenceUnavailableError

            try:
                return push_weights(quote(learner), version=version, versions=quote(versions), **push_kw)
            except InferenceUnavailableError as e:  # the server died: bring it back, then push again
                pipeline.recover(e)
                return push_weights(quote(learner), version=version, versions=quote(versions), **push_kw)

        for step in range(run.start_step, steps):
            t_step = time.perf_counter()
            pipeline.fill(step)
            t_wait = time.perf_counter()
            batch, t_submit = pipeline.next_batch()
            t_got = time.perf_counter()
            m = dict(batch.metrics)
            m.update(
                assign_advantages(
                    batch.groups,
                    step=step,
                    max_staleness=a.max_staleness,
                    sync_every=cfg.sync.sync_every,
                    scale=a.scale,
                    filter_zero_std=a.filter_zero_std,
                )
            )
            writer = persist_step.submit(root, run.run_id, step, quote(batch.groups))
            t0 = time.perf_counter()
            m.update(train_on_batch(quote(learner), quote(batch.groups)))
            trained[0] = step + 1
            overhead = (time.perf_counter() - t0) - m["train/seconds"]
            m["sync_seconds"] = 0.0
            if (step + 1) % cfg.sync.sync_every == 0 or step == steps - 1:
                t0 = time.perf_counter()
                sm = push(step + 1)
                m.update(sm)
                m["sync_seconds"] = time.perf_counter() - t0
                overhead += m["sync_seconds"] - sm.get("sync/total_seconds", m["sync_seconds"])
            m["write_seconds"] = writer.result()
            m["policy_version"] = versions.get()
            m["server_restarts"] = pipeline.restarts
            # Dispatch latency of the rollout task and result hand-off are Prefect's, not ours.
            overhead += max(0.0, batch.body_start - t_submit) + max(0.0, t_got - max(batch.body_end, t_wait))
            m.update(step_timing(t_step, t_wait, t_got, overhead))
            # The steps row lands before the checkpoint: a kill in between resumes from the previous
            # checkpoint, which deletes this step's rows and redoes it, so no table ever lacks a row.
            store.write_step(run.run_id, step, m)
            if (step + 1) % cfg.run.checkpoint_every == 0 or step == steps - 1:
                m["checkpoint_seconds"] = save_checkpoint(
                    quote(learner),
                    root=root,
                    run_id=run.run_id,
                    step=step,
                    state=checkpoint_state(cfg, run.run_id, step, trained[0]),
                    keep=cfg.run.keep_checkpoints,
                )
                m.update(step_timing(t_step, t_wait, t_got, overhead))
                store.write_step(run.run_id, step, m)  # the same row, now with the checkpoint's time
            reporter.step(step, m)
        reporter.finish()
    return reporter.summary()


def checkpoint_state(cfg: GRPOConfig, run_id: str, step: int, version: int) -> dict[str, Any]:
    """What a resume needs beside the weights and optimizer: where the data and the policy stand."""
    return {
        "step": step,
        "policy_version": version,
        "data_cursor": (step + 1) * cfg.data.prompts_per_step,
        "run_id": run_id,
    }


def step_timing(t_step: float, t_wait: float, t_got: float, overhead: float) -> dict[str, float]:
    wall = time.perf_counter() - t_step
    return {
        "wall_seconds": wall,
        "wait_seconds": t_got - t_wait,  # time the learner idled waiting for generation
        "prefect_overhead_seconds": overhead,
        "prefect_overhead_frac": overhead / wall if wall > 0 else 0.0,
    }
