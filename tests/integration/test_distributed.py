"""The sharded learner (learner.world_size 2: Ray actors, gloo, FSDP2) on the tiny model, on the
session's local Ray: its step equals the single process's on the same batch, its checkpoints load at
world size 1 and 2, and a rank that dies or stalls fails the step with its error, never hanging it."""

from __future__ import annotations

import os
import random
import re
import signal

import pytest
import torch

from grpoflow.tasks.config.algorithm import AlgorithmConfig
from grpoflow.tasks.config.learner import LearnerConfig
from grpoflow.tasks.learner.learn import Learner
from grpoflow.tasks.learner.learner_api import LearnerRun, TrainSample
from grpoflow.tasks.tiny_model import build_tiny_model
from tests.support import wait_for

pytestmark = pytest.mark.integration

LR = 1e-3
# The ranks sum the same gradients in another order (float32), and Adam's first steps move every
# weight by about lr whatever its gradient's size, so weights agree to a small fraction of lr.
WEIGHT_ATOL = 2e-3 * LR


def learner_run(model_dir) -> LearnerRun:
    """Every learner here: a 10-step schedule, the tiny model's tokenizer."""
    return LearnerRun(total_steps=10, tokenizer_path=model_dir)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray for this module's ranks (2 CPUs: one per rank)."""
    pytest.importorskip("ray")
    from grpoflow.flows.processes.cluster import ray_cluster
    from grpoflow.tasks.config.run import ScaleConfig

    with ray_cluster(ScaleConfig(ray_address="local", num_cpus=2)) as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def batch(seed: int) -> list[TrainSample]:
    """4 groups x 4: prompts of different lengths, a zero-advantage group (skipped, still counted by
    the normaliser) and a sample with masked tokens (a tool result)."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(5, 14))]
        for k in range(4):
            t = rng.randint(3, 10)
            mask = [1] * t if (g, k) != (1, 2) else [1, 1, 0, 0] + [1] * (t - 4)
            adv = 0.0 if g == 2 else [1.0, -1.0, 0.5, -0.5][k]
            comp = [rng.randrange(3, 250) for _ in range(t)]
            out.append(TrainSample(prompt + comp, len(prompt), mask, [-4.0] * t, adv))
    return out


def configs(**learner) -> tuple[LearnerConfig, AlgorithmConfig]:
    # 3 samples per micro-batch: the parts' micro-batch counts are odd, so a rank runs a filler.
    lc = LearnerConfig(lr=LR, micro_batch_size=3, mini_batches=2, torch_threads=1, **learner)
    return lc, AlgorithmConfig(loss_type="dapo", num_iterations=2)


def weights(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def sharded(model_dir, **learner):
    from grpoflow.tasks.learner.distributed import DistributedLearner

    lc, ac = configs(world_size=2, **learner)
    return DistributedLearner(model_dir, lc, ac, learner_run(model_dir))


def single(model_dir) -> Learner:
    lc, ac = configs()
    return Learner(model_dir, lc, ac, learner_run(model_dir))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < WEIGHT_ATOL, worst


def saved_weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return weights(load_file(str(directory / "model.safetensors")))


@pytest.fixture(scope="module")
def two_steps(cluster, model_dir, tmp_path_factory):
    """One process trains two steps; two ranks train the first, write weights and a checkpoint."""
    out = tmp_path_factory.mktemp("dist")
    ref = single(model_dir)
    first = ref.train_step(batch(1))
    after_one = weights(ref.model.state_dict())
    second = ref.train_step(batch(2))
    d = sharded(model_dir)
    try:
        got = d.train_step(batch(1))
        d.write_weights(out / "weights")
        d.save(out / "ckpt")
    finally:
        d.close()
    return {"first": first, "second": second, "after_one": after_one, "after_two": weights(ref.model.state_dict()),
            "got": got, "out": out}  # fmt: skip


def test_two_ranks_make_the_single_process_update(two_steps):
    one, two = two_steps["first"], two_steps["got"]
    # Two iterations x two mini-batches: four optimizer steps, the later ones with ratios != 1.
    assert two["train/optimizer_steps"] == one["train/optimizer_steps"] == 4
    assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-5)
    for k in ("train/iter1/loss", "train/grad_norm", "train/ratio_max", "train/ratio_min", "train/tokens"):
        assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    assert one["train/ratio_max"] != 1.0  # the second iteration's ratios moved: pi_old was used
    assert two["train/skipped_zero_advantage"] == one["train/skipped_zero_advantage"] == 4
    # The full weights the ranks gathered for vLLM (tied aliases dropped) are the single process's.
    assert_same_weights(saved_weights(two_steps["out"] / "weights"), two_steps["after_one"])


def test_a_checkpoint_saved_at_two_ranks_resumes_at_one_and_at_two(two_steps, model_dir):
    ckpt = two_steps["out"] / "ckpt"
    assert (ckpt / "optimizer" / ".metadata").is_file()  # torch.distributed.checkpoint format
    assert_same_weights(saved_weights(ckpt / "model"), two_steps["after_one"])
    lc, ac = configs()
    one = Learner(ckpt / "model", lc, ac, learner_run(model_dir))
    one.load_trainer_state(ckpt)
    m1 = one.train_step(batch(2))
    # The resumed step is the uninterrupted run's second step: the optimizer's moments came back.
    assert m1["train/loss"] == pytest.approx(two_steps["second"]["train/loss"], abs=1e-5)
    assert m1["train/lr"] == two_steps["second"]["train/lr"]
    assert_same_weights(weights(one.model.state_dict()), two_steps["after_two"])

    from grpoflow.tasks.learner.distributed import DistributedLearner

    lc2 = lc.model_copy(update={"world_size": 2})
    d = DistributedLearner(ckpt / "model", lc2, ac, learner_run(model_dir))
    try:
        d.load_trainer_state(ckpt)
        m2 = d.train_step(batch(2))
        d.write_weights(two_steps["out"] / "resumed")
    finally:
        d.close()
    assert m2["train/loss"] == pytest.approx(two_steps["second"]["train/loss"], abs=1e-5)
    assert_same_weights(saved_weights(two_steps["out"] / "resumed"), two_steps["after_two"])


def test_fresh_moments_would_differ(two_steps, model_dir):
    """The resume test above can fail: without the optimizer state the same step lands elsewhere."""
    lc, ac = configs()
    fresh = Learner(two_steps["out"] / "ckpt" / "model", lc, ac, learner_run(model_dir))
    fresh.train_step(batch(2))
    a, b = weights(fresh.model.state_dict()), two_steps["after_two"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 10 * WEIGHT_ATOL


def _wait_dead(pids: list[int]) -> None:
    from grpoflow.storage.processes import alive

    wait_for(lambda: not any(alive(p) for p in pids), 30.0, f"the ranks {pids} to exit", interval_s=0.2)


@pytest.mark.parametrize(
    ("fault", "rank", "says"),
    [
        ("learner_rank:kill", 1, "(?i)died"),  # the last rank dies at the step's start
        ("learner_rank:sleep=3600", 0, "(?i)timed out"),  # it stalls: rank 0's collective times out
    ],
)
def test_a_dead_or_stalled_rank_fails_the_step_within_the_collective_timeout(
    cluster, model_dir, monkeypatch, fault, rank, says
):
    import ray

    from grpoflow.tasks.learner.distributed import LearnerRankError

    monkeypatch.setenv("GRPOFLOW_FAULTS", fault)
    d = sharded(model_dir, collective_timeout_s=5.0)
    pids = ray.get([r.pid.remote() for r in d.ranks])
    # The stalled rank sleeps longer than the test's own limit (pytest-timeout): the step's end at all is
    # the collective timeout, and `says` names it.
    with pytest.raises(
        LearnerRankError, match=rf"rank {rank} \(on [0-9.]+\) failed while running a train step"
    ) as e:
        d.train_step(batch(1))
    assert re.search(says, str(e.value) + repr(e.value.__cause__)), (str(e.value), repr(e.value.__cause__))
    # Every rank is gone (none left waiting in a collective), and the learner refuses further work.
    _wait_dead(pids)
    with pytest.raises(LearnerRankError, match="stopped after rank"):
        d.train_step(batch(1))


def test_sigkill_of_a_rank_from_outside(cluster, model_dir):
    """A rank killed by the OS (not by a failpoint) between steps: the next step fails naming it."""
    import ray

    from grpoflow.tasks.learner.distributed import LearnerRankError

    d = sharded(model_dir, collective_timeout_s=5.0)
    pids = ray.get([r.pid.remote() for r in d.ranks])
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(LearnerRankError, match=r"rank 1 \(on [0-9.]+\) failed while running a train step"):
        d.train_step(batch(1))
    _wait_dead(pids)
