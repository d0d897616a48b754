"""Reruns reproduce, bit for bit, on the real vLLM server: the same config and seed trained twice give
the same rollouts (token ids and vLLM's logprobs), reward cells, advantages, `steps` metrics (times
aside) and final weights (flows/viewing/compare.py, what `grpoflow compare` prints). On-policy runs reproduce
as they are; runs that generate ahead (max_staleness 2) with run.reproducible, with tools and an
environment, also when the second one is SIGKILLed mid-run and resumed.

The two runs of a test share the session's server, one after the other, each from the base weights
(the run's first push loads them: inference.url is external)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.flows.viewing.compare import identical, report
from tests.support import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _sets(root: Path, model: Path, url: str, *more: str, seed: int = 7) -> list[str]:
    return [f"storage.root={root}", f"model.path={model}", f"inference.url={url}", f"run.seed={seed}", *more]


def _same(root: Path, a: str, b: str) -> dict:
    summary = report(root, a, b)
    assert identical(summary), summary
    assert summary["environment_differences"] == [], summary
    return summary


def test_an_on_policy_run_trained_twice_is_the_same_bits(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    from grpoflow.flows.training.train import grpo_train

    sets = _sets(tmp_path, tiny_model_dir, vllm_server.url, "run.steps=4", "algorithm.max_staleness=0")
    for run in ("a", "b"):
        grpo_train(config=load_config(CONFIGS / "tiny-letters.yaml", [*sets, f"run.run_id={run}"]))
    summary = _same(tmp_path, "a", "b")
    assert summary["rollouts_total"] == 4 * 8 * 8
    _replays_of_a(tmp_path)


def _replays_of_a(root: Path) -> None:
    """grpo-replay (flows/lineage/replay.py), the learner's half of run a on its stored groups: with a's own
    config, a's weights bit for bit; with another loss and a `--where`, exactly the groups it picks."""
    from grpoflow.flows.lineage.replay import grpo_replay
    from grpoflow.storage.rollouts import RolloutStore
    from grpoflow.storage.sql import query

    grpo_replay(run="a", root=str(root))
    again = report(root, "a", "a-replay")
    assert again["weights_bitwise_equal"] and again["advantages_equal"], again
    assert again["rollouts_identical"] == again["rollouts_total"] == 4 * 8 * 8, again
    assert RolloutStore(root).read_run_meta("a-replay")["replay_of"] == "a"

    where = "prompt_index % 2 = 0"  # every other prompt's group
    grpo_replay(
        run="a", sets=["algorithm.loss_type=dr_grpo"], where=where, replay_id="a-drgrpo", root=str(root)
    )
    picked = "SELECT step, list(DISTINCT row_id ORDER BY row_id) FROM rollouts WHERE run_id = $run {} GROUP BY step ORDER BY step"
    _, want = query(
        root,
        picked.format(f"AND group_id IN (SELECT group_id FROM rollouts WHERE run_id = 'a' AND {where})"),
        {"run": "a"},
    )
    _, got = query(root, picked.format(""), {"run": "a-drgrpo"})
    assert got == want and [len(ids) for _, ids in got] == [4] * 4, (got, want)
    _, loss = query(
        root, "SELECT DISTINCT run_id, \"train/loss\" IS NOT NULL FROM steps WHERE run_id = 'a-drgrpo'"
    )
    assert loss == [("a-drgrpo", True)]


def test_a_reproducible_run_ahead_with_tools_survives_a_kill_and_resume_bit_for_bit(
    tmp_path, vllm_server, tiny_model_dir, prefect_api, counter_env_warmup
):
    """max_staleness 2: each push waits for the two batches generated ahead, and the checkpoint after
    step 3 keeps batches 4 and 5. Run b is SIGKILLed as step 4 starts training (its 5th train step),
    then resumed: steps 4 and 5 train on the kept batches, generated under versions 2 and 3 as in run
    a, and nothing differs. Both runs train in `grpoflow train` processes of their own, as a user
    reruns a config: what the tests before left in this process (its threads, its imports, its
    background threads) is no part of either run, and both set the learner's threads
    (learner.torch_threads): another thread count is another run."""
    from prefect.settings import PREFECT_API_URL

    config = CONFIGS / "tiny-counter-env.yaml"
    sets = _sets(tmp_path, tiny_model_dir, vllm_server.url, "run.steps=6", "run.checkpoint_every=2",
                 "algorithm.max_staleness=2", "run.reproducible=true", "learner.torch_threads=1",
                 seed=0)  # fmt: skip
    counter_env_warmup(tmp_path)  # the config's warm-up at seed 0, run once a session
    args = ["--config", str(config), *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    cmd = [sys.executable, "-m", "grpoflow.flows.cli.main", "train"]

    def train(*more: str, faults: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*cmd, *more, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**env, "GRPOFLOW_FAULTS": faults} if faults else env)  # fmt: skip

    done = train("--run-id", "a")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    killed = train("--run-id", "b", faults="train@5:kill")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "b" / "step-000003" / "ahead.pkl").is_file()  # batches 4 and 5
    resumed = train("--resume", "b")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]

    summary = _same(tmp_path, "a", "b")
    assert summary["rollouts_total"] == 6 * 4 * 4
