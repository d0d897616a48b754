"""What a verifiers episode costs over grpoflow's own rollout (issue 49), the model's time left out.

The same rows, answered by the SCRIPTED FAKE backend (tests/unit/scripted.py: instant, fixed replies) on
SmolLM2's tokenizer and template, generated three ways with `generate_groups`:

- `grpoflow`: grpoflow's own single-turn rollouts of the rows' prompts (one request per group);
- `vf_sum`: the same prompts as the single-turn verifiers environment of tests/integration/vf_envs, each
  episode run by verifiers (its `null` harness program in a subprocess, the interception server, its
  scoring) with grpoflow's `PolicyClient`;
- `vf_tally`: the multi-turn one: a tool call to its MCP tool server (one started per episode), an
  answer, a follow-up user turn and a last answer (3 model turns).

Prints one JSON line per way: wall seconds for the batch and per rollout (after one warm-up batch, which
prepares the harness program's environment with uv).

    .venv/bin/python benchmarks/verifiers_episodes.py [--tasks 8] [--group 4]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import time

REPO = Path(__file__).resolve().parent.parent
ENVS = REPO / "tests" / "integration" / "vf_envs"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "smollm2-135m"))
    args = ap.parse_args()
    paths = [str(ENVS / "vf_sum"), str(ENVS / "vf_tally")]
    sys.path[:0] = [*paths, str(REPO)]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)

    from transformers import AutoTokenizer

    from grpoflow.tasks.config.rollouts import ToolsConfig
    from grpoflow.tasks.rollouts.verifiers_env import task_rows
    from tests.unit.scripted import scripted_groups, tool_call

    tok = AutoTokenizer.from_pretrained(args.tokenizer)

    async def script(text, k, seed):
        turn = text.count("<|im_start|>assistant") - 1
        if "tally" in text:
            return [tool_call("tally_toolset_tally", n=2), "Two marks.", "done"][min(turn, 2)]
        return "3"

    def batch(block):
        if block is None:
            rows = [
                {"prompt": [{"role": "user", "content": r["prompt"]}]} for r in task_rows(SUM, args.tasks)
            ]
            return scripted_groups(tok, script, rows, ToolsConfig(), group_size=args.group, max_turns=1)
        return scripted_groups(tok, script, task_rows(block, args.tasks), ToolsConfig(verifiers=block),
                               group_size=args.group, max_turns=5)  # fmt: skip

    SUM = {"taskset": {"id": "vf_sum", "num_tasks": args.tasks}}
    TALLY = {"taskset": {"id": "vf_tally", "num_tasks": args.tasks}}
    for name, block in (("grpoflow", None), ("vf_sum", SUM), ("vf_tally", TALLY)):
        batch(block)  # warm-up
        t0 = time.perf_counter()
        groups = batch(block)
        dt = time.perf_counter() - t0
        n = sum(len(g.completions) for g in groups)
        turns = sum(len(c.turns) for g in groups for c in g.completions) / n
        print(json.dumps({"way": name, "rollouts": n, "turns": turns, "seconds": round(dt, 3),
                          "per_rollout_s": round(dt / n, 4)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
