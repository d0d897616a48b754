"""The units of work of one training step, each with one name.

generate -> score (`rollout_batch`, task `rollout-batch`; the held-out split's: `eval-batch`), advantages
(`assign_advantages`, tasks/advantages.py), update (`update`), persist (`persist`, task `persist-step`), push
(`push_weights`, task `push-weights`), checkpoint (`save_checkpoint`, task `checkpoint`); `train_step` (task
`train-step`) is the task run that records the learner's side of a step (update, persist, push) in the Prefect
UI. How they run, as task runs or plain calls (`task.fn(...)`, as tests call them), is the flow's runner's
choice (flows/training/runner.py). Each unit takes its own config sections (through `RolloutJob`, built once
per run). Big objects (groups, the learner, the jobs) reach tasks wrapped in `quote(...)` so Prefect's
argument walker never traverses token lists. A step's figures are one typed record, `StepRecord`
(tasks/step_record.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.faults import failpoint
from grpoflow.storage.records import RolloutGroup
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.push.push import PushStats, WeightPush, push_version
from grpoflow.tasks.rewards.broken_rewards import BrokenReward, MaskedBatch, broken_rewards, masked_batch
from grpoflow.tasks.rewards.reward_kwargs import TrainerState
from grpoflow.tasks.rewards.vf_reward import episode_metrics
from grpoflow.tasks.rollouts.replicas import ReplicaSet
from grpoflow.tasks.rollouts.reproducible import save_kept
from grpoflow.tasks.rollouts.sampling import NO_SIGNAL, DynamicSampling, select
from grpoflow.tasks.step_record import StepRecord


@dataclass
class RolloutBatch:
    """What one generate -> score unit hands to the trainer."""

    step: int
    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    body_start: float = 0.0  # perf_counter at task-body start/end (Prefect overhead accounting)
    body_end: float = 0.0
    broken: list[BrokenReward] = field(default_factory=list)  # rewards failed on every completion
    masked: MaskedBatch | None = None  # every completion masked for want of valid rewards


@dataclass
class RolloutJob:
    """What every step's generate -> score needs: the servers (routing, the version each serves), the
    tokenizer and the config sections of generation, tools, rewards and the client."""

    tokenizer_path: str
    generation: GenerationConfig
    tools: ToolsConfig
    rewards: list[RewardConfig]
    inference: InferenceConfig
    seed: int | None
    servers: ReplicaSet
    max_steps: int = 0  # the run's steps, and its dataset's rows: reward functions' `trainer_state`
    rows_per_epoch: int = 0
    split: str = "train"  # the groups' split: 'eval' for the held-out rows (grpo-evaluate, run.eval_every)
    sampling: DynamicSampling | None = None  # algorithm.dynamic_sampling (training batches only)


async def _generate(rows, prompt_indices, job: RolloutJob) -> list[RolloutGroup]:
    from grpoflow.tasks.rollouts.generate import generate_groups
    from grpoflow.tasks.rollouts.inference import client_for
    from grpoflow.tasks.rollouts.replicas import Servers
    from grpoflow.tasks.rollouts.templates import load_tokenizer

    kw = dict(
        tokenizer=load_tokenizer(job.tokenizer_path),
        generation=job.generation,
        tools=job.tools,
        seed=job.seed,
        split=job.split,
    )
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(client_for(url, job.inference, job.generation.max_in_flight))
            for url in job.servers.urls
        ]
        return await generate_groups(rows, prompt_indices, servers=Servers(job.servers, clients), **kw)


async def _rollout_async(step: int, rows, prompt_indices, job: RolloutJob) -> RolloutBatch:
    from grpoflow.tasks.rewards.score import reward_metrics, score_groups_async

    t0 = time.perf_counter()
    groups = await _generate(rows, prompt_indices, job)
    t1 = time.perf_counter()
    # The servers' health as generation ended (scoring may take long; a revival may end meanwhile).
    servers = _server_metrics(groups, job.servers, t1 - t0)
    epoch = prompt_indices[0] / job.rows_per_epoch if job.rows_per_epoch and prompt_indices else 0.0
    state = TrainerState(global_step=step, epoch=epoch, max_steps=job.max_steps)
    _keyed_rewards(step, groups, job)
    metrics = await score_groups_async(groups, job.rewards, state)
    gen_s, score_s = t1 - t0, metrics["score_seconds"]
    if job.sampling is not None and job.split == "train":
        more, gen_more, score_more, rounds = await _more_rounds(step, groups, job, state)
        groups += more
        gen_s, score_s = gen_s + gen_more, score_s + score_more
        metrics.update(reward_metrics(groups, job.rewards))
        metrics.update(_sampling_metrics(groups, job.sampling, len(groups) - len(more), rounds))
    broken = broken_rewards(groups, job.rewards)
    for b in broken:  # said at once; the flow decides to stop
        say = _run_logger().error if b.required else _run_logger().warning
        say("step %d: %s\n%s", step, b.line(), b.trace or "")
    masked = masked_batch(groups, job.rewards) if job.split == "train" else None
    if masked is not None and not any(b.required for b in broken):  # a broken one's line says why
        _run_logger().error("step %d: %s; it trains nothing", step, masked.line())
    metrics.update(_generation_metrics(groups, gen_s))
    metrics.update(servers)
    metrics["score_seconds"] = score_s
    return RolloutBatch(step, groups, metrics, t0, time.perf_counter(), broken, masked)


def _keyed_rewards(step: int, groups: list[RolloutGroup], job: RolloutJob) -> None:
    """verifiers rewards that returned keyed scores become one entry per key, for this batch and every
    one after (tasks/rewards/vf_reward.py: `keyed_rewards`); the run's `rewards` list is changed in place."""
    from grpoflow.tasks.rewards.vf_reward import keyed_rewards

    if (found := keyed_rewards(job.rewards, groups)) is None:
        return
    job.rewards[:], became = found
    weights = {r.name: r.weight for r in job.rewards}
    for fn, keys in became.items():
        said = ", ".join(f"{k!r} (weight {weights[k]:g})" for k in keys) or "none"
        _run_logger().info("step %d: verifiers reward %r returned keyed scores: %s", step, fn, said)


async def _more_rounds(step: int, groups: list[RolloutGroup], job: RolloutJob, state: TrainerState):
    """Dynamic sampling's further rounds, while the step holds fewer than prompts_per_step groups with
    reward variance: (the new groups, their generation seconds, their scoring seconds)."""
    from grpoflow.tasks.rewards.score import score_groups_async

    ds, more, gen_s, score_s, rounds = job.sampling, [], 0.0, 0.0, 1
    for rnd in range(1, ds.max_rounds):
        kept = select(groups + more, ds.per_step)
        if kept >= ds.per_step:
            break
        rows, indices = ds.round_rows(step, rnd, ds.next_round_size(kept, len(groups) + len(more)))
        t0 = time.perf_counter()
        new = await _generate(rows, indices, job)
        t1 = time.perf_counter()
        await score_groups_async(new, job.rewards, state)
        gen_s, score_s = gen_s + t1 - t0, score_s + time.perf_counter() - t1
        more += new
        rounds = rnd + 1
    kept = select(groups + more, ds.per_step)
    if kept < ds.per_step:
        _run_logger().warning(
            "step %d: dynamic sampling found %d of %d groups with reward variance in %d "
            "rounds; training on those",
            step,
            kept,
            ds.per_step,
            ds.max_rounds,
        )
    return more, gen_s, score_s, rounds


def _sampling_metrics(
    groups: list[RolloutGroup], ds: DynamicSampling, first_round: int, rounds: int
) -> dict[str, float]:
    kept = sum(g.dropped is None for g in groups)
    return {
        "sampling/rounds": float(rounds),
        "sampling/groups_generated": float(len(groups)),
        "sampling/extra_groups": float(len(groups) - first_round),
        "sampling/groups_kept": float(kept),
        "sampling/groups_short": float(ds.per_step - kept),
        "sampling/signal_frac": sum(g.dropped != NO_SIGNAL for g in groups) / max(1, len(groups)),
    }


def _run_logger():
    """The Prefect run's logger (the terminal and the UI), or this module's outside any run."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _generation_metrics(groups: list[RolloutGroup], seconds: float) -> dict[str, float]:
    comps = [c for g in groups for c in g.completions]
    tokens = sum(sum(c.completion_mask) for c in comps)
    calls = [tc for c in comps for tc in c.tool_calls]
    return {
        "gen_seconds": seconds,
        "gen/completions": float(len(comps)),
        "gen/tokens": float(tokens),
        "gen/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "gen/truncated_frac": sum(c.truncated for c in comps) / max(1, len(comps)),
        "gen/tool_calls": float(len(calls)),
        "gen/tool_failures": float(sum(tc.failed for tc in calls)),
    } | episode_metrics([c.verifiers for c in comps if c.verifiers is not None])


def _server_metrics(groups: list[RolloutGroup], replicas: ReplicaSet, seconds: float) -> dict[str, float]:
    """Per-server share of the batch (several servers only) and every server's health."""
    out = replicas.metrics()
    if len(replicas) > 1:
        for rep in replicas.replicas:
            mine = [c for g in groups for c in g.completions if c.server == rep.url]
            tokens = sum(sum(c.completion_mask) for c in mine)
            out[f"gen/server{rep.index}/completions"] = float(len(mine))
            out[f"gen/server{rep.index}/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return out


@task(name="rollout-batch", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def rollout_batch(
    step: int, rows, prompt_indices, job: RolloutJob, handoff: Future | None = None
) -> RolloutBatch:
    """Generate the groups of one step on the vLLM server, then score them (one worker thread). With
    `handoff` the batch is also handed over through it the moment it is ready, before Prefect records
    the run's end: the flow takes it from there (`handed_over`)."""
    batch = asyncio.run(_rollout_async(step, rows, prompt_indices, job))
    if handoff is not None:
        handoff.set_result(batch)
    return batch


# The held-out split scored between training steps (run.eval_every): the same unit, its own name.
eval_batch = rollout_batch.with_options(name="eval-batch")


def handed_over(future, handoff: Future):
    """A submitted task's result, from `handoff` once its body has set it; when the task failed (after
    its retries), its error, from its future (a Prefect future, or a plain one)."""
    wait([handoff, getattr(future, "wrapped_future", future)], return_when=FIRST_COMPLETED)
    return handoff.result() if handoff.done() else future.result()


def update(learner, groups: list[RolloutGroup]) -> dict[str, float]:
    """Train on the step's trained completions; the learner's train/ figures."""
    from grpoflow.tasks.learner.learner_api import samples_from_groups

    failpoint("train")
    return learner.train_step(samples_from_groups(groups))


@task(name="persist-step", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def persist(root: str, run_id: str, step: int, groups: list[RolloutGroup]) -> float:
    """Write the step's rollouts and rewards (atomic Parquet files); returns seconds."""
    t0 = time.perf_counter()
    store = RolloutStore(Path(root))
    store.write_rollouts(run_id, step, groups)
    store.write_rewards(run_id, step, groups)
    return time.perf_counter() - t0


@task(name="push-weights", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def push_weights(learner, version: int, pusher: WeightPush, servers: ReplicaSet) -> PushStats:
    """Push the learner's weights into every serving server as `version` (tasks.push.push_version)."""
    return push_version(pusher, learner.write_weights, version, servers)


@task(name="train-step", cache_policy=NO_CACHE)
def train_step(outcome: Future) -> StepRecord:
    """The Prefect task run of a step's learner side (update, persist, push), which the flow runs
    itself: submitted as the step starts, it ends with the step's record or its error.

    A task run costs Prefect's engine milliseconds of the calling thread before its body starts and
    after it returns (the run's states, events and logs); here they are spent on the task runner's
    thread, beside the update, not on the step's critical path (BENCHMARKS.md, "Prefect's share of a
    step"). The UI shows the run, its duration within those milliseconds, its failure, and one log
    line of what the step wrote, trained and pushed."""
    from prefect.logging import get_run_logger

    record = outcome.result()
    get_run_logger().info(record.summary())
    return record


@task(name="checkpoint", cache_policy=NO_CACHE, retries=1)
def save_checkpoint(
    learner, *, root: str, run_id: str, step: int, state: dict, keep: int, kept: list[RolloutBatch] = ()
) -> float:
    """The learner's state, and `kept`: the batches generated ahead (run.reproducible), which a resume
    from this checkpoint trains on as they are."""
    t0 = time.perf_counter()

    def write(directory: Path) -> None:
        learner.save(directory)
        save_kept(directory, list(kept))

    CheckpointStore(Path(root)).save(run_id, step, write, state, keep_last=keep)
    failpoint("checkpoint_done")
    return time.perf_counter() - t0
