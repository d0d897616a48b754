"""TRL's quickstart, with its one import changed to `grpoflow.trl`: reward functions defined in this
module (a lambda among them), a `datasets.Dataset.from_list`, `GRPOConfig(...)`, `GRPOTrainer(...).train()`,
on the tiny model and the session's real vLLM server, under the real Prefect API; then what the trainer
gives after a run (TRL's `state.log_history`, reading callbacks, `save_model`, `sql`, `explore`)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query

pytestmark = pytest.mark.integration

STEPS, G, BATCH = 3, 4, 4  # optimizer steps, completions per prompt, completions per forward pass


def letter_count(completions, **kwargs):  # a reward function of the script, as TRL's quickstart has
    return [float(sum(ch.isalpha() for ch in c)) for c in completions]


def test_a_trl_quickstart_trains_with_one_import_changed(tmp_path, tiny_model_dir, vllm_server, prefect_api):
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpoflow.trl import GRPOConfig, GRPOTrainer

    seen: list[tuple[str, int, dict | None]] = []

    class Record(TrainerCallback):  # reads only: grpoflow calls it from the run's step rows
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(("step_end", state.global_step, None))

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(("log", state.global_step, dict(logs)))

        def on_train_end(self, args, state, control, **kwargs):
            seen.append(("train_end", state.global_step, None))

    dataset = Dataset.from_list([{"prompt": f"Say {w}:", "word": w} for w in ("cat", "dog", "owl", "emu")])
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        num_generations=G,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2,  # 8 completions per optimizer step: 2 prompts
        max_steps=STEPS,
        logging_steps=1,
        save_steps=2,
        max_completion_length=8,
        learning_rate=1e-3,
        grpoflow={"inference.url": vllm_server.url},  # the session's server, not an embedded one
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[
            letter_count,
            lambda completions, word, **kw: [float(w in c) for c, w in zip(completions, word, strict=True)],
        ],
        args=args,
        train_dataset=dataset,
        callbacks=[Record],
    )
    out = trainer.train()
    run, root = trainer.run_id, tmp_path / "out"

    # TRL's log_history: one entry per logged step, TRL's names, from the store's rows
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [1, 2, 3] and out.global_step == trainer.state.global_step == 3
    for key in ("loss", "reward", "reward_std", "rewards/letter_count/mean", "rewards/<lambda>/mean",
                "completions/mean_length", "completions/clipped_ratio", "learning_rate", "num_tokens"):  # fmt: skip
        assert all(key in e for e in history), key
    _, lengths = query(root, f"SELECT step, avg(completion_tokens) FROM rollouts WHERE run_id = '{run}' GROUP BY step ORDER BY step")  # fmt: skip
    assert [e["completions/mean_length"] for e in history] == pytest.approx([r[1] for r in lengths])
    steps = sorted(RolloutStore(root).read_steps(run), key=lambda r: r["step"])
    assert [e["reward"] for e in history] == pytest.approx([r["reward/mean"] for r in steps])

    # the callbacks saw every step end, each log entry, then the end
    assert [s for s in seen if s[0] == "step_end"] == [("step_end", n, None) for n in (1, 2, 3)]
    assert [s[2] for s in seen if s[0] == "log"] == history
    assert seen[-1] == ("train_end", 3, None)

    # the rows are the run's: written once into its store, named by the flow's parameters
    meta = RolloutStore(root).read_run_meta(run)
    data_path = meta["config"]["data"]["path"]
    assert data_path.endswith(f"datasets/{run}/train.parquet")
    _, words = query(root, f"SELECT DISTINCT prompt FROM rollouts WHERE run_id = '{run}'")
    assert {w[0] for w in words} <= {f"Say {w}:" for w in ("cat", "dog", "owl", "emu")}
    # the lambda ran in this process, with the dataset's column: its cells are all valid
    _, cells = query(root, f"SELECT status, count(*) FROM rewards WHERE run_id = '{run}' AND reward_name = '<lambda>' GROUP BY status")  # fmt: skip
    assert cells == [("valid", STEPS * 2 * G)]

    # after the run: the model exported, SQL as a DataFrame, the explorer's page of the run
    exported = trainer.save_model(str(tmp_path / "model"))
    assert (exported / "config.json").is_file()
    frame = trainer.sql(f"SELECT step, \"reward/mean\" FROM steps WHERE run_id = '{run}' ORDER BY step")
    assert list(frame["step"]) == [0, 1, 2]
    url = trainer.explore()
    assert url.endswith(f"#/run/{run}")
    with urllib.request.urlopen(url.split("#")[0] + "api/runs", timeout=30) as r:
        assert run in json.dumps(json.load(r))
