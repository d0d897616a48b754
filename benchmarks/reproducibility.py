"""Reproducibility check: run one config twice with the same seed and print the first difference.

Starts ONE vLLM server for both runs (the config's model: `model.path: tiny` builds the tiny model
under the store root), puts the base weights back into it before each run, then trains run `repro-a`
and run `repro-b` one after the other in this process (`flows.training.train.grpo_train`, same `run.seed`,
same store root), and compares what they wrote:

    .venv/bin/python benchmarks/reproducibility.py --config configs/tiny-letters.yaml
        [--set KEY=VALUE ...] [--steps 12] [--seed 7] [--kills N] [--root DIR] [--keep]

--kills N: run `repro-b` as `grpoflow train` processes instead, SIGKILLed N times at seeded random
failpoints (tests/drill.py's random drill: each kill at a (failpoint, hit) reached within a launch's
first two steps) and resumed after each.

--root DIR keeps the store there (it must not hold runs `repro-a` / `repro-b` yet); without it a temp
dir is used, removed at the end unless --keep.

Then prints what `grpoflow compare repro-a repro-b` prints (flows/viewing/compare.py: each item identical,
or its first difference) and a JSON line of the summary: {"rollouts_identical", "rollouts_total",
"rewards_equal", "advantages_equal", "steps_equal", "weights_max_abs_diff", "weights_bitwise_equal",
"environment_differences"}.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script,
# and import this checkout's packages (not those an editable install of another checkout points to).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import shutil
import tempfile
import time

from grpoflow.flows.viewing.compare import report

RUNS = ("repro-a", "repro-b")


def base_weights(url: str, model_dir: Path, inference) -> None:
    """Put the base model's weights back into the server (version 0), as the integration tests do."""
    from grpoflow.tasks.config.inference import SyncConfig
    from grpoflow.tasks.push.push import load_version, weight_push

    with tempfile.TemporaryDirectory(prefix="grpoflow-restore-") as tmp:
        load_version(weight_push(tmp, "restore", SyncConfig(), inference), url, model_dir, 0)


def train_twice(config: str, overrides: list[str], root: Path, kills: int = 0) -> None:
    """Runs RUNS one after the other on one shared server, each from the base weights; with `kills`,
    the second one SIGKILLed that many times and resumed."""
    from grpoflow.flows.cli.shared import quiet_prefect_task_logs
    from grpoflow.flows.config import load_config
    from grpoflow.flows.processes.prefect_api import owned_prefect_api
    from grpoflow.flows.processes.serve import start_server
    from grpoflow.flows.training.runs import prepare_model
    from grpoflow.flows.training.train import grpo_train

    quiet_prefect_task_logs()
    base = load_config(config, overrides)
    model = prepare_model(base)
    lora = base.learner.lora
    with owned_prefect_api():
        server = start_server(model, log_path=root / "vllm.log", max_model_len=base.inference.max_model_len,
                              kv_cache_gb=base.inference.kv_cache_gb, startup_timeout_s=600,
                              lora_rank=lora.served_rank() if lora else None,
                              max_loras=base.inference.max_loras)  # fmt: skip
        try:
            for run in RUNS:
                base_weights(server.url, model, base.inference)
                sets = [*overrides, f"inference.url={server.url}"]
                t0 = time.perf_counter()
                if kills and run == RUNS[-1]:
                    print(f"{run}: {killed(config, sets, root, run, kills)}", flush=True)
                else:
                    grpo_train(config=load_config(config, [*sets, f"run.run_id={run}"]))
                print(f"trained {run} in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            server.stop()


def killed(config: str, sets: list[str], root: Path, run: str, kills: int) -> dict:
    """`run` trained by `grpoflow train` processes, SIGKILLed `kills` times at seeded random failpoints
    (tests/drill.py STEP_POINTS) and resumed after each; the drill's figures."""
    from prefect.settings import PREFECT_API_URL

    from tests.drill import STEP_POINTS, random_kill_drill

    fig = random_kill_drill(root, run, sets, kills=kills, seed=0, points=STEP_POINTS, config=config,
                            env={"PREFECT_API_URL": str(PREFECT_API_URL.value())})  # fmt: skip
    if not fig["completed"]:
        raise RuntimeError(f"{run} did not complete after its kills: {fig['final_output']}")
    if fig["fired"] != [[p] for p in fig["planned"]]:
        raise RuntimeError(f"{run}: a planned kill did not fire: {fig}")
    return {k: fig[k] for k in ("kills", "planned", "finished_early", "orphans")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--kills", type=int, default=0, help="SIGKILL the second run this many times")
    ap.add_argument("--root", type=Path, help="the store (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp store")
    args = ap.parse_args()
    root = (args.root or Path(tempfile.mkdtemp(prefix="grpoflow-repro-"))).resolve()
    overrides = [f"storage.root={root}", *args.set, f"run.steps={args.steps}", f"run.seed={args.seed}"]
    print(f"config {args.config} {' '.join(args.set)} steps={args.steps} seed={args.seed} store={root}")
    try:
        train_twice(args.config, overrides, root, args.kills)
        summary = report(root, *RUNS)
        print(json.dumps(summary), flush=True)
    finally:
        if args.root is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
