"""The held-out eval split: stable row ids, a hash-chosen fraction, an eval file, and bad settings."""

from __future__ import annotations

import json

import pytest

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.lineage.evaluate import eval_rows
from grpoflow.flows.training.data import load_rows, split_rows
from grpoflow.flows.training.preflight import preflight
from grpoflow.storage.ids import held_out, row_id_of
from tests.support import REPO

pytestmark = pytest.mark.unit


def cfg_with(**data) -> GRPOConfig:
    return GRPOConfig.model_validate({"data": {"generator": "grpoflow.examples.envs:letters_rows", **data}})


def test_row_ids_come_from_the_id_field_else_from_the_content():
    assert row_id_of({"prompt": "x", "id": 7}) == "7" and row_id_of({"prompt": "x", "id": "a-1"}) == "a-1"
    plain = {"prompt": "What is 2 + 2?", "answer": "4"}
    assert row_id_of(plain) == row_id_of({"answer": "4", "prompt": "What is 2 + 2?"})  # key order
    assert row_id_of(plain) != row_id_of({**plain, "answer": "5"}) and row_id_of(plain).startswith("sha256:")
    assert row_id_of({"prompt": "x", "id": True}).startswith("sha256:")  # a bool is not an id


def test_the_held_out_fraction_is_stable_under_growth_and_reordering():
    cfg = cfg_with(generator_kwargs={"n": 400}, eval_fraction=0.25)
    train, held = split_rows(cfg, [{"prompt": f"p{i}", "id": i} for i in range(400)])
    assert 60 < len(held) < 140 and len(train) + len(held) == 400  # ~100: a hash, not a count
    grown = [{"prompt": f"p{i}", "id": i} for i in range(800)][::-1]
    train2, held2 = split_rows(cfg, grown)
    ids = {row_id_of(r) for r in held}
    assert ids <= {row_id_of(r) for r in held2}  # every row held out before still is
    assert not ids & {row_id_of(r) for r in train2}
    assert all(held_out(row_id_of(r), 0.25) for r in held2)


def test_preflight_returns_only_training_rows():
    cfg = cfg_with(generator_kwargs={"n": 64}, eval_fraction=0.3)
    rows = preflight(cfg)
    assert rows and not any(held_out(row_id_of(r), 0.3) for r in rows)
    evaluated, source = eval_rows(cfg, None)
    assert source == "eval" and evaluated and all(held_out(row_id_of(r), 0.3) for r in evaluated)
    assert len(eval_rows(cfg, 2)[0]) == 2


def test_an_eval_file_holds_its_rows_out_of_training(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "held", "id": i}) for i in (3, 5)) + "\n")
    cfg = cfg_with(generator_kwargs={"n": 8}, eval_path=str(path))
    train, held = split_rows(cfg, [{"prompt": f"p{i}", "id": i} for i in range(8)])
    assert [r["id"] for r in held] == [3, 5] and [r["id"] for r in train] == [0, 1, 2, 4, 6, 7]


def test_without_a_split_evaluation_says_it_uses_training_rows():
    rows, source = eval_rows(cfg_with(generator_kwargs={"n": 40}), None)
    assert source == "train" and [r["id"] for r in rows] == list(range(24, 40))


def test_bad_eval_settings_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="data.eval_path or data.eval_fraction, not both"):
        load_config(None, ["data.eval_path=x.jsonl", "data.eval_fraction=0.1"])
    with pytest.raises(ConfigError, match="data.eval_fraction"):
        load_config(None, ["data.eval_fraction=1.5"])
    with pytest.raises(ConfigError, match="data.eval_path: file not found"):
        split_rows(cfg_with(eval_path=str(tmp_path / "none.jsonl")), [{"prompt": "p"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ConfigError, match="data.eval_path: row 0 has no 'prompt' field"):
        split_rows(cfg_with(eval_path=str(bad)), [{"prompt": "p"}])
    every = tmp_path / "every.jsonl"
    every.write_text('{"prompt": "p", "id": 1}\n')
    with pytest.raises(ConfigError, match="none is left to train on"):
        split_rows(cfg_with(eval_path=str(every)), [{"prompt": "p", "id": 1}])


def test_a_generators_eval_part_is_the_eval_split_and_never_trained_on():
    """data.eval_generator_kwargs: the generator's own held-out rows (the SmolLM2 demo's `part: eval`
    pairs) are the eval split; its rows' ids differ from the training rows', so none is dropped."""
    cfg = load_config(REPO / "configs" / "smollm2-demo.yaml")
    train, held = split_rows(cfg, load_rows(cfg))
    assert len(train) == 512 and len(held) == 64
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held}
    assert eval_rows(cfg, 8) == (held[:8], "eval")
    with pytest.raises(
        ValueError, match="data.eval_generator_kwargs: set it or data.eval_fraction, not both"
    ):
        cfg_with(eval_generator_kwargs={"part": "eval"}, eval_fraction=0.1)
