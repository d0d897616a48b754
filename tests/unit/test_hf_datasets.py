"""Hugging Face datasets as data sources: a save_to_disk directory in data.path, data.dataset through
datasets.load_dataset, data.eval_split; bad input is one ConfigError line naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.flows.config import ConfigError, load_config
from grpoflow.flows.training.data import load_rows, split_rows
from grpoflow.flows.training.preflight import confine, preflight
from grpoflow.storage.ids import row_id_of

pytestmark = pytest.mark.unit

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]


def conversation(i: int) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": f"What is {i} + {i}?"},
        ],
        "solution": str(2 * i),
    }


ROWS = [conversation(i) for i in range(6)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """datasets' Arrow cache in the test's own folder, never the user's ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def cfg(tmp_path: Path, *sets: str):
    return load_config(None, [f"storage.root={tmp_path / 'store'}", *sets])


def saved(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def saved_dict(path: Path, **splits: list[dict]) -> Path:
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(
        str(path)
    )
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line_error(e: pytest.ExceptionInfo, field: str) -> str:
    msg = str(e.value)
    assert msg.startswith(f"{field}: "), msg
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


# --- data.path: a save_to_disk directory -----------------------------------------------------------


def test_a_saved_conversational_dataset_loads_as_plain_rows(tmp_path):
    c = cfg(tmp_path, f"data.path={saved(tmp_path / 'ds', ROWS)}")
    rows = load_rows(c)
    assert rows == ROWS
    assert type(rows[0]) is dict and type(rows[0]["prompt"]) is list
    assert all(type(m) is dict for r in rows for m in r["prompt"])
    assert preflight(c) == ROWS
    assert len({row_id_of(r) for r in rows}) == len(ROWS)


def test_a_dataset_dict_loads_its_train_split_and_eval_split_holds_out_test(tmp_path):
    test = [ROWS[0], conversation(100)]  # ROWS[0] is in both: it must not be trained on
    d = saved_dict(tmp_path / "dd", train=ROWS, test=test)
    assert load_rows(cfg(tmp_path, f"data.path={d}")) == ROWS
    assert load_rows(cfg(tmp_path, f"data.path={d}", "data.split=test")) == test
    c = cfg(tmp_path, f"data.path={d}", "data.eval_split=test")
    train, held = split_rows(c, load_rows(c))
    assert held == test
    assert train == ROWS[1:]
    assert preflight(c) == ROWS[1:]


def test_eval_path_may_be_a_saved_directory(tmp_path):
    c = cfg(
        tmp_path,
        f"data.path={saved(tmp_path / 'ds', ROWS)}",
        f"data.eval_path={saved(tmp_path / 'ev', ROWS[:2])}",
    )
    train, held = split_rows(c, load_rows(c))
    assert held == ROWS[:2] and train == ROWS[2:]


def test_rows_with_non_json_columns_hash(tmp_path):
    import datetime

    rows = [{"prompt": "p", "at": datetime.datetime(2024, 1, i + 1)} for i in range(3)]
    loaded = load_rows(cfg(tmp_path, f"data.path={saved(tmp_path / 'ds', rows)}"))
    assert len({row_id_of(r) for r in loaded}) == 3
    assert [row_id_of(r) for r in loaded] == [row_id_of(r) for r in rows]


# --- data.dataset: datasets.load_dataset -----------------------------------------------------------


def test_a_json_builder_with_data_files_loads(tmp_path):
    f = jsonl(tmp_path / "rows.jsonl", ROWS)
    c = cfg(tmp_path, f"data.dataset={{path: json, data_files: {f}}}")
    assert load_rows(c) == ROWS
    assert preflight(c) == ROWS


def test_a_parquet_builder_with_data_files_loads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), f)
    c = cfg(tmp_path, f"data.dataset={{path: parquet, data_files: {f}}}")
    assert load_rows(c) == ROWS


def test_eval_split_of_a_dataset(tmp_path):
    tr, te = jsonl(tmp_path / "train.jsonl", ROWS), jsonl(tmp_path / "test.jsonl", ROWS[:1])
    c = cfg(
        tmp_path,
        f"data.dataset={{path: json, data_files: {{train: {tr}, test: {te}}}}}",
        "data.eval_split=test",
    )
    train, held = split_rows(c, load_rows(c))
    assert held == ROWS[:1] and train == ROWS[1:]


def test_a_saved_directory_as_data_dataset_path(tmp_path):
    d = saved_dict(tmp_path / "dd", train=ROWS, test=ROWS[:1])
    assert load_rows(cfg(tmp_path, f"data.dataset={{path: {d}, split: test}}")) == ROWS[:1]


def test_relative_paths_are_found_beside_the_config(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    jsonl(proj / "rows.jsonl", ROWS)
    saved(proj / "ds", ROWS[:2])
    reward = "rewards: [{name: r, fn: 'grpoflow.examples.rewards:letter_fraction'}]\n"
    (proj / "a.yaml").write_text(
        reward + "data:\n  dataset: {path: json, data_files: {train: [rows.jsonl]}}\n"
    )
    (proj / "b.yaml").write_text(reward + "data:\n  dataset: {path: ds}\n")
    (proj / "c.yaml").write_text(reward + "data:\n  path: ds\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    a = load_config(proj / "a.yaml")
    assert a.data.dataset.path == "json" and a.data.dataset.data_files == {
        "train": [str(proj / "rows.jsonl")]
    }
    assert load_rows(a) == ROWS
    assert load_rows(load_config(proj / "b.yaml")) == ROWS[:2]
    assert load_rows(load_config(proj / "c.yaml")) == ROWS[:2]


# --- bad input: one ConfigError line naming the field ------------------------------------------------


def test_a_split_that_does_not_exist(tmp_path):
    d = saved_dict(tmp_path / "dd", train=ROWS, test=ROWS[:1])
    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.path={d}", "data.split=foo"))
    assert one_line_error(e, "data.split") == f"data.split: no split 'foo' in {d} (splits: train, test)"

    tr = jsonl(tmp_path / "train.jsonl", ROWS)
    files = f"{{train: {tr}, test: {tr}}}"
    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.dataset={{path: json, data_files: {files}, split: foo}}"))
    assert (
        one_line_error(e, "data.dataset.split")
        == "data.dataset.split: no split 'foo' in json (splits: train, test)"
    )

    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.dataset={{path: json, data_files: {files}}}", "data.eval_split=dev"))
    assert one_line_error(e, "data.eval_split").endswith("(splits: train, test)")

    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.path={d}", "data.eval_split=dev"))
    one_line_error(e, "data.eval_split")


def test_a_data_file_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.dataset={{path: json, data_files: [{tmp_path / 'none.jsonl'}]}}"))
    assert "none.jsonl" in one_line_error(e, "data.dataset.data_files: file not found")


def test_a_dataset_path_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.dataset={{path: {tmp_path / 'nothing'}}}"))
    one_line_error(e, "data.dataset.path: not found")


def test_a_directory_that_is_no_saved_dataset(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.path={tmp_path / 'plain'}"))
    assert "is not a saved dataset" in one_line_error(e, "data.path")
    with pytest.raises(ConfigError) as e:
        preflight(
            cfg(tmp_path, f"data.path={saved(tmp_path / 'ds', ROWS)}", f"data.eval_path={tmp_path / 'plain'}")
        )
    one_line_error(e, "data.eval_path")


def test_datasets_errors_are_wrapped_in_one_line(tmp_path, capfd):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(ConfigError) as e:
        preflight(cfg(tmp_path, f"data.dataset={{path: json, data_files: {bad}}}"))
    msg = one_line_error(e, "data.dataset")
    assert msg.startswith("data.dataset: cannot load 'json': DatasetGenerationError: "), msg
    assert "(ArrowInvalid: JSON parse error" in msg and "not json" not in msg, msg
    assert capfd.readouterr().err == ""  # datasets' own log lines and progress bars stay quiet


@pytest.mark.parametrize(
    "sets, line",
    [
        (
            ["data.path=a.jsonl", "data.dataset={path: json}"],
            "data.dataset: set data.path or data.dataset, not both",
        ),
        (
            ["data.dataset={path: json}", "data.eval_path=e.jsonl", "data.eval_split=test"],
            "data.eval_split: set data.eval_split or data.eval_path, not both",
        ),
        (
            ["data.dataset={path: json}", "data.eval_fraction=0.1", "data.eval_split=test"],
            "data.eval_split: set data.eval_split or data.eval_fraction, not both",
        ),
        (
            ["data.eval_split=test"],
            "data.eval_split: needs data.dataset or a DatasetDict directory in data.path",
        ),
    ],
)
def test_conflicting_sources_are_refused(sets, line):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[1].strip().startswith(line), str(e.value)


def test_without_the_datasets_package(tmp_path, monkeypatch):
    d = saved(tmp_path / "ds", ROWS)
    f = jsonl(tmp_path / "rows.jsonl", ROWS)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    for field, sets in [
        ("data.path", [f"data.path={d}"]),
        ("data.dataset", [f"data.dataset={{path: json, data_files: {f}}}"]),
    ]:
        with pytest.raises(ConfigError) as e:
            preflight(cfg(tmp_path, *sets))
        assert one_line_error(e, field) == (
            f"{field}: loading Hugging Face datasets needs the 'datasets' package: pip install 'grpoflow[datasets]'"
        )
    assert load_rows(cfg(tmp_path, f"data.path={f}")) == ROWS  # JSONL needs no datasets


def test_worker_allow_lists_cover_the_dataset_paths(tmp_path, monkeypatch):
    inside = tmp_path / "inside"
    inside.mkdir()
    monkeypatch.setenv("GRPOFLOW_ALLOWED_ROOTS", str(inside))
    outside = jsonl(tmp_path / "rows.jsonl", ROWS)
    ok = jsonl(inside / "rows.jsonl", ROWS)
    root = f"storage.root={inside / 'store'}"
    confine(load_config(None, [root, f"data.dataset={{path: json, data_files: {ok}}}"]))
    for sets, field in [
        (
            [f"data.dataset={{path: json, data_files: {{train: [{ok}, {outside}]}}}}"],
            "data.dataset.data_files",
        ),
        ([f"data.dataset={{path: {tmp_path / 'ds'}}}"], "data.dataset.path"),
        (
            ["data.dataset={path: json, data_files: 'https://example.com/rows.jsonl'}"],
            "data.dataset.data_files",
        ),
        (["data.dataset={path: trl-lib/DeepMath-103K}"], "data.dataset.path"),  # a Hub name: never fetched
    ]:
        with pytest.raises(ConfigError) as e:
            confine(load_config(None, [root, *sets]))
        one_line_error(e, field)


# --- the CLI: `grpoflow train` refuses before any model loads ------------------------------------------

PROBE = """
import sys
from grpoflow.flows.cli.main import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules)
print("RC", rc, "HEAVY", ",".join(heavy) or "-")
"""


def test_train_refuses_a_split_that_does_not_exist(tmp_path):
    tr = jsonl(tmp_path / "train.jsonl", ROWS)
    root = tmp_path / "store"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "train", "--root", str(root), "--set",
         f"data.dataset={{path: json, data_files: {{train: {tr}, test: {tr}}}, split: foo}}"],
        cwd=REPO,
        env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "HF_DATASETS_CACHE": str(tmp_path / "hf")},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    last = out.stdout.strip().splitlines()[-1]
    assert last == "RC 2 HEAVY -", out.stdout + out.stderr
    assert out.stderr == "error: data.dataset.split: no split 'foo' in json (splits: train, test)\n", (
        out.stderr
    )
    assert not root.exists()
