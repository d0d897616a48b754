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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
