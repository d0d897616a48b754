"""Two (or more) runs of one store side by side: training reward and held-out eval reward against step
and against training wall seconds (the sum of the steps' `wall_seconds`, eval time excluded), as one
PNG, with the figures printed as JSON lines.

    .venv/bin/python benchmarks/compare_runs.py --root /tmp/smol smol-eval smol-dapo --out fig.png

Used for the dynamic sampling figure in BENCHMARKS.md (the SmolLM2 demo with and without
`algorithm.dynamic_sampling`, both with `run.eval_every=5`).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json

from grpoflow.storage.sql import query


def curves(root: str, run: str) -> dict[str, list]:
    _, rows = query(root, """
        SELECT step, "reward/mean", "eval/reward/mean", sum(wall_seconds) OVER (ORDER BY step)
        FROM steps WHERE run_id = $run ORDER BY step""", {"run": run})  # fmt: skip
    return {
        "step": [r[0] for r in rows],
        "reward": [r[1] for r in rows],
        "seconds": [r[3] for r in rows],
        "eval": [(r[0], r[3], r[2]) for r in rows if r[2] is not None],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--root", default="runs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    for run in args.runs:
        c = curves(args.root, run)
        line = by_step.plot(c["step"], c["reward"], alpha=0.5, label=f"{run}: training reward")[0]
        by_time.plot(c["seconds"], c["reward"], alpha=0.5, color=line.get_color())
        steps, secs, ev = zip(*c["eval"], strict=True) if c["eval"] else ((), (), ())
        by_step.plot(steps, ev, "D-", color=line.get_color(), label=f"{run}: held-out eval")
        by_time.plot(secs, ev, "D-", color=line.get_color())
        print(json.dumps({"run": run, "steps": len(c["step"]), "train_seconds": round(c["seconds"][-1], 1),
                          "eval": [[s, round(t, 1), round(v, 3)] for s, t, v in c["eval"]]}))  # fmt: skip
    by_step.set(xlabel="step", ylabel="reward (valid completions)")
    by_time.set(xlabel="training wall seconds (eval excluded)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(args.out)


if __name__ == "__main__":
    main()
