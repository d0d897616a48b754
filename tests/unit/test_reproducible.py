"""run.reproducible's pieces without a server: the batches a checkpoint keeps, the pipeline's settle and
its use of kept batches, and the record a rerun is compared by. (The same bits end to end, on the real
server, with a kill and resume: tests/integration/test_reproducibility.py.)"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from grpoflow.flows.config import load_config
from grpoflow.flows.training.pipeline import RolloutPipeline
from grpoflow.tasks.rollouts.reproducible import KEPT_FILE, environment, load_kept, mismatches, save_kept
from grpoflow.tasks.steps import RolloutBatch
from tests.support import rich_group

pytestmark = pytest.mark.unit


def _batch(step: int) -> RolloutBatch:
    return RolloutBatch(step, [rich_group(f"train-{step:08d}")], {"reward/mean": 0.5})


def test_a_checkpoint_keeps_its_batches_and_a_resume_reads_them_back(tmp_path):
    save_kept(tmp_path, [_batch(4), _batch(5)])
    back = load_kept(tmp_path)
    assert [b.step for b in back] == [4, 5]
    assert (
        back[0].groups[0].completions[0].completion_ids == _batch(4).groups[0].completions[0].completion_ids
    )
    assert back[1].groups[0].group_id == "train-00000005" and back[1].metrics == {"reward/mean": 0.5}


def test_nothing_to_keep_writes_nothing_and_reads_as_none(tmp_path):
    save_kept(tmp_path, [])
    assert not (tmp_path / KEPT_FILE).exists()
    assert load_kept(tmp_path) == [] and load_kept(None) == []


def test_a_batch_that_cannot_be_pickled_costs_the_resume_not_the_checkpoint(tmp_path, caplog):
    batch = _batch(4)
    batch.groups[0].row["lock"] = threading.Lock()  # e.g. an environment snapshot holding a lock
    with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.rollouts.reproducible"):
        save_kept(tmp_path, [batch])
    assert not (tmp_path / KEPT_FILE).exists()
    assert "generates them again" in caplog.text and "lock" in caplog.text


def test_kept_batches_that_cannot_be_read_back_cost_the_resume_only_its_reproducibility(tmp_path, caplog):
    save_kept(tmp_path, [_batch(4)])
    data = (tmp_path / KEPT_FILE).read_bytes()
    # as if the class a snapshot was pickled from had moved since: unpickling names a module that is gone
    (tmp_path / KEPT_FILE).write_bytes(data.replace(b"grpoflow.storage.records", b"grpoflow.storage.gone_xx"))
    with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.rollouts.reproducible"):
        assert load_kept(tmp_path) == []
    assert "cannot be read back" in caplog.text and "generates them again" in caplog.text


def test_the_record_names_what_a_rerun_must_match():
    import torch

    env = environment(7)
    assert env["seed"] == 7 and env["torch_threads"] == torch.get_num_threads()
    assert environment(7, torch_threads=3)["torch_threads"] == 3  # the learner's own (learner.torch_threads)
    assert env["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert mismatches(env, dict(env)) == []
    other = {**env, "seed": 8, "threads_env": {**env["threads_env"], "OMP_NUM_THREADS": "3"}}
    lines = mismatches(env, other)
    assert "seed: 7 vs 8" in lines
    assert any(line.startswith("threads_env.OMP_NUM_THREADS: ") and line.endswith("'3'") for line in lines)
    assert mismatches(env, None) == [
        "a run has no reproducibility record (it ran before grpoflow recorded one)"
    ]


class _Runner:
    """Records what the pipeline submits (the real runner would start rollout-batch task runs)."""

    def __init__(self):
        self.submitted: list[int] = []

    def submit(self, task, step, *args):
        self.submitted.append(step)
        return Future()

    def waited(self, batch, t_wait):
        pass


def _pipeline(kept=(), max_staleness=2, reproducible=True):
    cfg = load_config(None, [f"algorithm.max_staleness={max_staleness}", "run.steps=10",
                             f"run.reproducible={reproducible}"])  # fmt: skip
    rows = [{"prompt": f"p{i}"} for i in range(64)]
    return RolloutPipeline(cfg, rows, servers=None, job=None, first_step=4, runner=_Runner(), kept=kept)


def _done(value=None, error=None) -> Future:
    f = Future()
    f.set_exception(error) if error else f.set_result(value)
    return f


def test_a_resumed_pipeline_takes_its_kept_batches_and_generates_only_the_rest():
    pipe = _pipeline(kept=[_batch(4), _batch(5)])
    assert pipe.next_batch(4).step == 4  # kept: no rollout-batch submitted for it
    assert pipe.runner.submitted == [6]  # steps 4..6 are due; 4 and 5 were kept
    assert [s for *_, s in pipe.ahead] == [5, 6]


def test_a_push_waits_for_every_batch_ahead_and_a_checkpoint_keeps_them():
    pipe = _pipeline()
    late = Future()
    pipe.ahead.extend([(_done(_batch(5)), _done(_batch(5)), 5), (late, Future(), 6),
                       (_done(error=RuntimeError("no server")), Future(), 7)])  # fmt: skip
    waited: list = []
    t = threading.Thread(target=lambda: waited.append(pipe.before_push()))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # batch 6 is still generating: the push must not land yet
    late.set_result(_batch(6))
    t.join(5)
    assert waited[0] >= 0.2
    # the failed batch 7 is left for next_batch to recover
    assert [b.step for b in pipe.to_keep()] == [5, 6]


def test_without_run_reproducible_a_push_waits_for_nothing_and_nothing_is_kept():
    pipe = _pipeline(reproducible=False)
    pipe.ahead.append((Future(), Future(), 5))  # generating, forever
    assert pipe.before_push() is None and pipe.to_keep() == []


def test_recovery_generates_again_only_the_batches_not_yet_handed_over():
    pipe = _pipeline()
    pipe.servers = SimpleNamespace(replicas=[SimpleNamespace(restart=lambda: None, healthy=True, alive=None)],
                                   serving=lambda: True)  # fmt: skip
    pipe.ahead.extend([(_done(_batch(5)), _done(_batch(5)), 5), (Future(), Future(), 6)])
    pipe.recover(RuntimeError("connection refused"))
    assert pipe.runner.submitted == [6]
    assert pipe.ahead[0][1].result().step == 5


def _run(root, run: str, logprob: float, weight: float) -> None:
    """A run of one step as the loop leaves it: rollouts, rewards, a steps row, a checkpoint."""
    import torch
    from safetensors.torch import save_file

    from grpoflow.storage.checkpoints import CheckpointStore
    from grpoflow.storage.rollouts import RolloutStore
    from tests.support import make_groups

    groups = make_groups()
    groups[1].completions[2].logprobs[-1] = logprob
    store = RolloutStore(root)
    store.write_rollouts(run, 0, groups)
    store.write_rewards(run, 0, groups)
    store.write_step(run, 0, {"reward/mean": 0.5, "wall_seconds": 1.0 + weight})  # times never compared

    def model(d):
        (d / "model").mkdir()
        save_file({"w": torch.full((2, 2), weight)}, str(d / "model" / "model.safetensors"))

    CheckpointStore(root).save(run, 0, model, {"step": 0})


def test_grpoflow_compare_says_identical_or_names_the_first_difference(tmp_path, capsys):
    from grpoflow.flows.cli import main as cli

    _run(tmp_path, "a", -1.0, 0.5)
    _run(tmp_path, "b", -1.0, 0.5)
    _run(tmp_path, "c", -1.0000001, 0.5)
    _run(tmp_path, "d", -1.0, 0.5000001)
    assert cli.main(["compare", "a", "b", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert sum(line.endswith(": identical") for line in out.splitlines()) == 4 and "bitwise equal" in out
    assert cli.main(["compare", "a", "c", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1. rollouts: 5/6 rows identical, 6/6 identical completions: FIRST DIFFERENCE rollouts" in out
    assert "group_id=g1 sample_index=2 logprobs[2]: -1.0 vs -1.0000001" in out
    assert cli.main(["compare", "a", "d", "--root", str(tmp_path)]) == 1
    assert "5. weights: checkpoints at steps 0 / 0, 1 tensors, 1 differ" in capsys.readouterr().out
