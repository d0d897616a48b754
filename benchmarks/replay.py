"""A replay's step (grpo-replay: the learner's half of a run, on its stored groups) against the live
step of the run it replays: it should cost the learner's share only.

Replays `--run` of the store at `--root` (a copy of it, in a temporary folder: the store is not
written) with the run's own config, then prints one JSON line: the medians over steps of each run's
`wall_seconds` (the step, from the previous step's end) and `train/seconds` (the learner's update), and
whether the replay's final weights are the run's bit for bit (`grpoflow compare`'s check).

    .venv/bin/python benchmarks/replay.py --root runs --run RUN
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import contextlib
import io
import json
import shutil
import tempfile

from grpoflow.flows.lineage.replay import grpo_replay
from grpoflow.flows.viewing.compare import report
from grpoflow.storage.sql import query


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="the store holding --run")
    ap.add_argument("--run", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpoflow-replay-") as tmp:
        root = Path(tmp) / "store"
        shutil.copytree(
            args.root, root, ignore=shutil.ignore_patterns("weights", "logs", "uploads", "reports")
        )
        replay = f"{args.run}-bench"
        grpo_replay(run=args.run, replay_id=replay, root=str(root))
        _, rows = query(
            root,
            'SELECT run_id, median(wall_seconds), median("train/seconds"), count(*) FROM steps '
            "WHERE run_id IN ($a, $b) GROUP BY run_id",
            {"a": args.run, "b": replay},
        )
        with contextlib.redirect_stdout(io.StringIO()):
            same = report(root, args.run, replay)["weights_bitwise_equal"]
    got = {r: (wall, train, n) for r, wall, train, n in rows}
    live, again = got[args.run], got[replay]
    print(
        json.dumps(
            {
                "run": args.run,
                "steps": again[2],
                "live_step_s": round(live[0], 3),
                "live_train_s": round(live[1], 3),
                "replay_step_s": round(again[0], 3),
                "replay_train_s": round(again[1], 3),
                "replay_over_live": round(again[0] / live[0], 3),
                "weights_bitwise_equal": same,
            }
        )
    )


if __name__ == "__main__":
    main()
