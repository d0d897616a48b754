"""A verifiers environment's rewards as reward cells (`tools.verifiers`, tasks/rollouts/verifiers_env.py).

verifiers scores each episode itself (its task's `@vf.reward` methods, plugged rewards and judges) and
records the scores on the episode's trace. Each reward is an entry of the run's `rewards` with
`fn: VERIFIERS_REWARD`, its name and weight (flows/training/environments.py: `check_verifiers` adds them), and
each rollout's cell is read from its episode's `VerifiersOutcome`, never called:

- a recorded score is `valid` (or `invalid` when NaN/inf);
- a reward verifiers left unscored (`None`: the function returned None, or scoring stopped before it)
  is `invalid`, or `failed` with verifiers' scoring error when there is one;
- an episode with errors (its harness, a tool server, the env's own `run`, the policy's requests) has
  every cell `failed`, with the first error: a partial episode's scores are not trained on.

Never a 0 in place of a missing score (verifiers' legacy rubric scores a raising reward 0.0).

A reward that returns keyed scores (`{"polite": ..., "brief": ...}`: verifiers records each key as a
reward of its own, with the function's weight) cannot be known before it has run: verifiers declares
the function only. `keyed_rewards` finds the keys in the first batch whose episodes recorded them, and
the function's entry becomes one entry per key, named and weighted as verifiers records them, for that
batch and every one after it (docs/environments.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpoflow.storage.records import RolloutGroup
    from grpoflow.tasks.config.rewards import RewardConfig

# The reward entry's `fn`: scoring reads the rollouts' outcomes instead of calling it.
VERIFIERS_REWARD = "grpoflow.tasks.rewards.vf_reward:verifiers_reward"


def verifiers_reward(**_: Any) -> list[float]:
    """Stands for a verifiers reward in a reward entry; never called (this module's doc)."""
    raise TypeError(f"{VERIFIERS_REWARD} is scored from each rollout's verifiers episode, not called")


@dataclass
class VerifiersOutcome:
    """What verifiers made of one episode: its rewards' scores (None: not scored), its metrics, the
    first error that spoils the whole episode (`error`) and the first of its scoring (`scoring_error`)."""

    scores: dict[str, float | None] = field(default_factory=dict)
    # the weights of the scores recorded, as verifiers weighs them
    weights: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    scoring_error: str | None = None


def _is_scoring(e: Any) -> bool:
    return e.type == "TaskError" and " scoring: " in (e.message or "")


def outcome_of(episode: Any) -> VerifiersOutcome:
    """The outcome of a finished verifiers `Episode` (its traces' rewards, metrics and errors)."""
    out = VerifiersOutcome()
    errors = list(episode.errors)
    for t in episode.traces:
        for name, r in t.rewards.items():
            if r is not None or name not in out.scores:
                out.scores[name] = None if r is None else float(r.score)
            if r is not None:
                out.weights[name] = float(r.weight)
        for name, v in t.metrics.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                out.metrics[name] = float(v)
        errors += t.errors
    for e in errors:
        line = f"{e.type}: {e.message}".strip()[:500]
        if _is_scoring(e):
            out.scoring_error = out.scoring_error or line
        else:
            out.error = out.error or line
    return out


def cell_of(outcome: VerifiersOutcome | None, name: str) -> tuple[float | None, str, str]:
    """(value, status, reason) of reward `name` in one rollout's outcome (this module's doc)."""
    if outcome is None:
        return None, "failed", "the rollout ran no verifiers episode"
    if outcome.error is not None:
        return None, "failed", f"the episode failed: {outcome.error}"
    if name not in outcome.scores:
        if outcome.scoring_error is not None:  # a keyed reward that stopped before it recorded its keys
            return None, "failed", f"verifiers' scoring failed: {outcome.scoring_error}"
        return None, "invalid", f"verifiers recorded no reward {name!r} for the episode"
    v = outcome.scores[name]
    if v is None:
        if outcome.scoring_error is not None and "'NoneType'" in outcome.scoring_error:
            # verifiers 0.4 cannot record a None score (its record_reward raises): scoring stopped there
            return None, "invalid", "not computed (None): verifiers stopped scoring the episode there"
        if outcome.scoring_error is not None:
            return None, "failed", f"verifiers' scoring failed: {outcome.scoring_error}"
        return None, "invalid", "verifiers reports it not computed (None)"
    if not math.isfinite(v):
        return None, "invalid", f"non-finite value {v}"
    return v, "valid", ""


def episode_metrics(outcomes: list[VerifiersOutcome]) -> dict[str, float]:
    """verifiers' metrics of a batch's episodes for its `steps` row: each one's mean as `vf/<name>`, and
    the share of episodes that failed as `vf/failed_frac`."""
    if not outcomes:
        return {}
    out: dict[str, float] = {"vf/failed_frac": sum(o.error is not None for o in outcomes) / len(outcomes)}
    names = sorted({k for o in outcomes for k in o.metrics})
    for k in names:
        vals = [o.metrics[k] for o in outcomes if k in o.metrics and math.isfinite(o.metrics[k])]
        if vals:
            out[f"vf/{k}"] = sum(vals) / len(vals)
    return out


def keyed_rewards(
    specs: list[RewardConfig], groups: list[RolloutGroup]
) -> tuple[list[RewardConfig], dict[str, list[str]]] | None:
    """`specs` with the verifiers rewards that returned keyed scores replaced by one entry per key
    (the module doc), and which function became which keys; None when no batch has shown keys yet (or
    they are all known). A function none of whose episodes recorded a score under its own name, while
    they recorded names no entry has, is keyed: with several such functions, the first takes every new
    key (verifiers does not record which function made which key), the others' entries go."""
    vf = [s for s in specs if s.fn == VERIFIERS_REWARD]
    if not vf:  # every batch of every run asks: one without verifiers rewards stops here
        return None
    outcomes = [c.verifiers for g in groups for c in g.completions if c.verifiers is not None]
    names = {s.name for s in specs}
    keys: dict[str, float] = {}  # in the order verifiers recorded them
    for o in outcomes:
        for k, w in o.weights.items():
            if k not in names:
                keys.setdefault(k, w)
    # verifiers seeds every function's name before scoring and drops the seed of one that returned keys
    scored = [o for o in outcomes if o.error is None and o.scores]
    keyed = [
        s
        for s in vf
        if any(s.name not in o.scores for o in scored) and all(o.scores.get(s.name) is None for o in scored)
    ]
    if not keys or not keyed:
        return None
    out: list[RewardConfig] = []
    for s in specs:
        if s is keyed[0]:
            out += [s.model_copy(update={"name": k, "weight": w}) for k, w in keys.items()]
        elif all(s is not k for k in keyed[1:]):
            out.append(s)
    return out, {keyed[0].name: list(keys), **{s.name: [] for s in keyed[1:]}}
