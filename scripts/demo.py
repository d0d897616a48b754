"""`make demo-smollm2` / `make demo-gemma3`: a real model learns on this machine's CPUs.

By default SmolLM2-135M-Instruct learns to reply to "What is a + b?" with only the number
(configs/smollm2-demo.yaml); `--config configs/gemma3-r1zero.yaml` trains Gemma 3 270M, a base model, on
plain-text prompts with a format and an accuracy reward (R1-Zero style).

Scores a held-out set greedily with the base model, trains, prints the mean reward of the first and last
5 steps, then scores the same held-out set greedily with the trained checkpoint. Held-out rows are the
config's eval split (`data.eval_generator_kwargs`: the generator's `part: eval` pairs), which training
never draws. All three share one embedded vLLM server (training pushes its weights into it; the last
evaluation pushes the final checkpoint), so the model loads once.

    .venv/bin/python scripts/demo.py [--seed N] [--root DIR] [--config YAML] [--set KEY=VALUE ...]

`--config configs/smollm2-demo-lora.yaml`: the same demo training a LoRA adapter (the server starts
with adapters enabled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="run.seed (sampling, data order, init)")
    ap.add_argument("--root", default="runs", help="store root (default: runs)")
    ap.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts scored greedily")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2-demo.yaml"), help="the demo's config")
    args = ap.parse_args()

    from grpoflow.flows.cli.shared import quiet_prefect_task_logs
    from grpoflow.flows.config import load_config
    from grpoflow.flows.lineage.evaluate import grpo_evaluate
    from grpoflow.flows.processes.prefect_api import owned_prefect_api
    from grpoflow.flows.processes.serve import inference_server
    from grpoflow.flows.processes.vllm_command import served_dtype
    from grpoflow.flows.training.runs import new_run_id
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.sql import query

    run_id = f"{Path(args.config).stem}-s{args.seed}-{new_run_id()[5:]}"
    sets = [f"storage.root={args.root}", f"run.seed={args.seed}", f"run.run_id={run_id}", *args.set]
    config = Path(args.config)
    base = load_config(config, sets)
    quiet_prefect_task_logs()
    with (
        owned_prefect_api(),
        inference_server(
            base.inference,
            base.model.path,
            args.root,
            f"vllm-{run_id}",
            lora=base.learner.lora,
            dtype=served_dtype(base),  # as the run's own servers
        ) as srv,
    ):
        cfg = load_config(config, [*sets, f"inference.url={srv.url}"])
        held_out = cfg  # the config's eval split: the generator's `part: eval` pairs
        before = grpo_evaluate(config=held_out, prompts=args.eval_prompts, greedy=True, server_url=srv.url)
        t0 = time.perf_counter()
        summary = grpo_train(config=cfg)
        train_seconds = time.perf_counter() - t0
        after = grpo_evaluate(
            config=held_out, run_id=run_id, prompts=args.eval_prompts, greedy=True, server_url=srv.url
        )
    _, rows = query(args.root, CURVE, {"run": run_id})
    rewards = [r for _, r in rows]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    result = {
        "run_id": run_id,
        "seed": args.seed,
        "steps": summary["steps_trained"],
        "train_seconds": round(train_seconds, 1),
        "first5_mean_reward": round(first, 4),
        "last5_mean_reward": round(last, 4),
        "gain": round(last - first, 4),
        "heldout_greedy_before": before["reward_mean"],
        "heldout_greedy_after": after["reward_mean"],
        "heldout_pass_rate_before": before["pass_rate"],
        "heldout_pass_rate_after": after["pass_rate"],
    }
    print(json.dumps(result, indent=1))
    return 0


CURVE = (
    "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts WHERE run_id = $run "
    "GROUP BY step ORDER BY step"
)

if __name__ == "__main__":
    sys.exit(main())
