"""`grpoflow dataset`: what a query of a real store selects, written as TRL's dataset formats (and as
JSON lines or Parquet), loaded back by `datasets`, and one step of TRL's SFTTrainer on it."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from grpoflow.flows.cli.main import main
from grpoflow.flows.config import ConfigError
from grpoflow.flows.lineage.dataset import export_dataset
from grpoflow.storage.records import RolloutCompletion, RolloutGroup, ToolCallRecord
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import QueryError

pytestmark = pytest.mark.unit

# The best valid completion of every group whose best reward is 1: rejection sampling's selection.
BEST = """SELECT run_id, prompt, completion, reward FROM rollouts
WHERE reward_valid AND reward = 1.0
QUALIFY row_number() OVER (PARTITION BY run_id, group_id ORDER BY reward DESC, sample_index) = 1
ORDER BY run_id, group_id"""


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir):
    """Two runs of two steps, each step one group of three completions rendered with the tiny model's
    chat template; the groups of step 1 of run `a` have no completion with reward 1."""
    from grpoflow.tasks.rollouts.templates import load_tokenizer, render

    tok = load_tokenizer(str(tiny_model_dir))
    root = tmp_path_factory.mktemp("store")
    rs = RolloutStore(root)
    for run in ("a", "b"):
        for step in (0, 1):
            prompt = render(
                tok, [{"role": "user", "content": f"Write a word with {step + 1} letters a."}], None, True
            )
            comps = []
            for i, text in enumerate(("banana", "xyz", "aa")):
                reward = 0.5 if (run, step) == ("a", 1) else float(text == "banana")
                ids = tok.encode(text + tok.eos_token, add_special_tokens=False)
                calls = [ToolCallRecord(0, "lookup", '{"key": 1}', "one", False)] if i == 2 else []
                comps.append(RolloutCompletion(i, text + tok.eos_token, ids, [1] * len(ids), [-1.0] * len(ids),
                                               tool_calls=calls, reward=reward, reward_valid=i != 1))  # fmt: skip
            ids = tok.encode(prompt, add_special_tokens=False)
            rs.write_rollouts(run, step, [RolloutGroup(f"{run}-g{step}", step, prompt, ids, comps)])
    return root


def test_trl_sft_rows_load_with_datasets_and_train_a_step_of_sft_trainer(store, tiny_model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    card = export_dataset(store, BEST, "trl-sft", tmp_path / "best")
    assert card["rows"] == 3 and card["runs"] == ["a", "b"]  # run a's step 1 had no reward of 1
    ds = datasets.load_dataset(str(tmp_path / "best"), split="train")
    assert ds.column_names == ["prompt", "completion"] and len(ds) == 3
    assert all(
        r["prompt"].startswith("<|im_start|>user\n") and r["completion"].startswith("banana") for r in ds
    )
    readme = (tmp_path / "best" / "README.md").read_text()
    assert "QUALIFY row_number()" in readme and "- rows: 3" in readme and "- runs: a, b" in readme

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=3,
                         learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds,
                             processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))  # fmt: skip
    assert trainer.train().global_step == 1
    assert any(not p.detach().equal(before[n]) for n, p in model.named_parameters())  # it learned something


def test_trl_prompt_keeps_the_other_columns_for_the_reward_functions(store, tmp_path):
    card = export_dataset(store, "SELECT DISTINCT prompt, run_id AS source FROM rollouts ORDER BY 2, 1",
                          "trl-prompt", tmp_path / "prompts")  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "prompts" / "train.jsonl").read_text().splitlines()]
    assert card["rows"] == 4 and card["runs"] is None  # no run_id column: the card says so
    assert [sorted(r) for r in rows] == [["prompt", "source"]] * 4 and rows[0]["source"] == "a"
    assert "not selected" in (tmp_path / "prompts" / "README.md").read_text()


def test_jsonl_and_parquet_keep_the_rows_as_selected_nested_columns_included(store, tmp_path):
    sql = "SELECT run_id, step, sample_index, completion_ids, tool_calls FROM rollouts WHERE len(tool_calls) > 0"
    export_dataset(store, sql, "jsonl", tmp_path / "j")
    export_dataset(store, sql, "parquet", tmp_path / "p")
    rows = [json.loads(line) for line in (tmp_path / "j" / "train.jsonl").read_text().splitlines()]
    table = pq.read_table(tmp_path / "p" / "train.parquet")
    assert len(rows) == table.num_rows == 4
    assert rows == json.loads(json.dumps(table.to_pylist()))
    assert rows[0]["tool_calls"][0]["name"] == "lookup" and all(
        isinstance(t, int) for t in rows[0]["completion_ids"]
    )


def test_a_query_that_cannot_make_the_format_is_refused_naming_the_column_and_nothing_is_written(
    store, tmp_path
):
    out = tmp_path / "x"
    with pytest.raises(ConfigError, match=r"trl-sft: the query selects no 'completion' column"):
        export_dataset(store, "SELECT prompt FROM rollouts", "trl-sft", out)
    with pytest.raises(ConfigError, match=r"'prompt' must be text"):
        export_dataset(store, "SELECT prompt_ids AS prompt, completion FROM rollouts", "trl-sft", out)
    with pytest.raises(ConfigError, match="selected no rows"):
        export_dataset(store, "SELECT prompt, completion FROM rollouts WHERE reward > 9", "trl-sft", out)
    with pytest.raises(QueryError, match="read-only"):
        export_dataset(store, f"COPY rollouts TO '{tmp_path / 'c.csv'}'", "jsonl", out)
    with pytest.raises(ConfigError, match="not one of"):
        export_dataset(store, BEST, "alpaca", out)
    assert not out.exists() and not (tmp_path / "c.csv").exists()
    (out / "keep").mkdir(parents=True)
    with pytest.raises(ConfigError, match="exists and is not an empty directory"):
        export_dataset(store, BEST, "trl-sft", out)
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_the_cli_writes_the_dataset_and_says_what_it_wrote(store, tmp_path, capsys):
    (tmp_path / "best.sql").write_text(BEST)
    assert main(["dataset", str(tmp_path / "d"), "--sql", f"@{tmp_path / 'best.sql'}", "--format", "trl-sft",
                 "--root", str(store)]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == f"3 rows (a, b) as trl-sft -> {tmp_path / 'd'}"
    assert main(["dataset", str(tmp_path / "e"), "--sql", "SELECT prompt FROM rollouts", "--format", "trl-sft",
                 "--root", str(store)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("error: --format trl-sft: the query selects no 'completion' column"), err
