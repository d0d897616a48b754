"""A train step's metrics (the steps table's train/ columns) from its optimizer updates, on one
rank or merged over the ranks of a sharded learner. Plain numbers: no torch, no model."""

from __future__ import annotations

from dataclasses import dataclass

# Per-iteration metrics in the steps table (train/iter<i>/<name>) when algorithm.num_iterations > 1.
ITERATION_METRICS = (
    "loss",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "clip_frac_low",
    "clip_frac_high",
    "policy_kl",
)


@dataclass
class StepRun:
    """What one train step's updates leave for the metrics (of one rank, or merged over ranks):
    per update (iteration, samples run, metrics), the step's completion tokens, zero-advantage samples
    left out, and the learning rate its first update ran at."""

    updates: list[tuple[int, int, dict[str, float]]]
    tokens: int
    skipped: int
    lr: float


def fold(pieces: list[tuple[float, float, dict[str, float]]], plain: tuple[str, ...]) -> dict[str, float]:
    """Several pieces' metrics as one: minima and maxima over all pieces; every other metric a sum
    weighted per piece, by its `plain` weight for the keys in `plain`, else by its sample weight.
    Micro-batches of one update: the loss (normalised over the whole update already) sums (plain 1),
    statistics average by samples. Updates of one step: the loss and grad norm average per update,
    statistics by samples."""
    out: dict[str, float] = {}
    for weight, plain_weight, m in pieces:
        for k, v in m.items():
            if v is None or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if k.endswith("_min"):
                out[k] = min(out.get(k, v), v)
            elif k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v * (plain_weight if k in plain else weight)
    return out


def _combine(updates: list[tuple[int, int, dict[str, float]]]) -> dict[str, float]:
    """The step's metrics from its updates' (iteration, samples run, metrics); an update that ran no
    sample (all advantages 0) weighs as much as any when none ran."""
    total = sum(n for _, n, _ in updates)
    per = 1 / len(updates)
    return fold([(n / total if total else per, per, m) for _, n, m in updates], ("loss", "grad_norm"))


def merge_ranks(runs: list[StepRun]) -> StepRun:
    """The ranks' runs of one step as one: each rank's metrics of an update are its share of the
    weighted sums (its micro-batches weighed against the whole update), so they add up; minima and
    maxima combine; the gradient norm is global already (every rank holds the same)."""
    first = runs[0]
    updates = []
    for u, (it, n, m) in enumerate(first.updates):
        merged = fold([(1.0, 1.0, r.updates[u][2]) for r in runs], ())
        merged["grad_norm"] = m["grad_norm"]
        updates.append((it, n, merged))
    return StepRun(updates, first.tokens, first.skipped, first.lr)


def empty_step_metrics(seconds: float) -> dict[str, float]:
    """The metrics of a step whose batch held no trainable sample: nothing ran."""
    return {"train/samples": 0.0, "train/skipped": 1.0, "train/seconds": seconds}


def step_metrics(run: StepRun, samples: int, iterations: int, seconds: float) -> dict[str, float]:
    """The steps table's train/ metrics of one step."""
    metrics = {"train/samples": float(samples)}
    metrics.update({f"train/{k}": v for k, v in _combine(run.updates).items()})
    if iterations > 1:
        for it in range(iterations):
            per = _combine([u for u in run.updates if u[0] == it])
            metrics.update({f"train/iter{it}/{k}": per[k] for k in ITERATION_METRICS if k in per})
    metrics.update(
        {
            "train/skipped_zero_advantage": float(run.skipped),
            "train/optimizer_steps": float(len(run.updates)),
            "train/grad_norm_max": max(m["grad_norm"] for _, _, m in run.updates),
            "train/lr": run.lr,
            "train/tokens": float(run.tokens),
            "train/tokens_per_s": run.tokens / seconds if seconds > 0 else 0.0,
            "train/seconds": seconds,
        }
    )
    return metrics
