"""`grpoflow rescore`: a stored run's completions scored again by other rewards, with the row columns of
its own dataset, through the live scorer; the cells in the `rescores` table, the run's files untouched."""

from __future__ import annotations

import hashlib
import json

import pytest

from grpoflow.flows.cli.main import main
from grpoflow.flows.config import ConfigError, load_config
from grpoflow.flows.lineage.rescore import BrokenRescore, rescore_run, reward_specs
from grpoflow.storage.ids import row_id_of
from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query, run_canned

pytestmark = pytest.mark.unit

ROWS = [{"id": i, "prompt": f"Say {w}.", "answer": w} for i, w in enumerate(("yes", "no", "maybe", "zzz"))]


@pytest.fixture
def store(tmp_path):
    """Run `r`: two steps of two groups (rows 0-1, then 2-3), two completions each, the first one
    saying the row's answer; its own reward `length` scored every cell valid."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(None, [f"data.path={data}", "run.run_id=r"])
    root = tmp_path / "store"
    rs = RolloutStore(root)
    rs.write_run_meta("r", {"run_id": "r", "status": "completed", "config": cfg.model_dump(mode="json")})
    for step in (0, 1):
        groups = []
        for row in ROWS[2 * step : 2 * step + 2]:
            comps = []
            for i, text in enumerate((f"I say {row['answer']}", "something else")):
                c = RolloutCompletion(
                    i, text, [1, 2], [1, 1], [-1.0, -1.0], reward=float(len(text)), reward_valid=True
                )
                c.reward_cells = [RewardCell("length", float(len(text)), "valid")]
                comps.append(c)
            groups.append(RolloutGroup(f"g{row['id']}", row["id"], row["prompt"], [5], comps,
                                       row_id=row_id_of(row)))  # fmt: skip
        rs.write_rollouts("r", step, groups)
        rs.write_rewards("r", step, groups)
    return root


def _files(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for t in ("rollouts", "rewards", "steps", "runs") for p in sorted((root / t).rglob("*")) if p.is_file()}  # fmt: skip


def test_a_rescore_gets_the_rows_columns_stores_failed_cells_never_zero_and_leaves_the_run_untouched(store):
    before = _files(store)
    specs = reward_specs(
        ["correct=tests.unit.reward_fns:answer_in", "strict=tests.unit.reward_fns:fails_on_zzz"]
    )
    done = rescore_run(store, "r", specs, name="fixed")
    assert (done["version"], done["cells"]) == (1, 16)
    assert done["statuses"] == {"correct": {"valid": 8}, "strict": {"valid": 4, "failed": 4}}
    assert _files(store) == before  # the run's own files, byte for byte

    _, cells = query(store, "SELECT step, group_id, sample_index, reward_name, value, status, reason, rescore, "
                            "version FROM rescores ORDER BY ALL")  # fmt: skip
    correct = {(g, i): v for _, g, i, name, v, *_ in cells if name == "correct"}
    assert correct == {(f"g{k}", i): float(i == 0) for k in range(4) for i in range(2)}  # the answer column
    strict = [c for c in cells if c[3] == "strict"]
    assert {(s, st) for s, _, _, _, _, st, *_ in strict} == {
        (0, "valid"),
        (1, "failed"),
    }  # row 3's batch raised
    assert all(
        v is None and "cannot score zzz" in reason
        for _, _, _, _, v, st, reason, *_ in strict
        if st == "failed"
    )
    assert {(c[7], c[8]) for c in cells} == {("fixed", 1)}

    # What the rescore judged otherwise than the run (whose reward was the length): in step 0 the
    # completions that say the answer (a total of length + 1), and every completion of step 1, whose new
    # total is not valid; the others' totals equal their lengths.
    cols, rows = run_canned(store, "rescore_disagreements", "r")
    got = [dict(zip(cols, r, strict=True)) for r in rows]
    assert [(r["step"], r["group_id"], r["sample_index"]) for r in got] == [
        (0, "g0", 0), (0, "g1", 0), (1, "g2", 0), (1, "g2", 1), (1, "g3", 0), (1, "g3", 1)
    ]  # fmt: skip
    assert [r["new_reward"] for r in got[:2]] == [r["reward"] + 1 for r in got[:2]]
    assert all(r["new_valid"] is False and r["new_reward"] is None for r in got if r["step"] == 1)
    assert (
        "strict: failed (ValueError: cannot score zzz)"
        in next(r for r in got if r["step"] == 1)["new_reason"]
    )
    assert rescore_run(store, "r", specs[:1])["version"] == 2  # a second rescore: a version of its own


def test_a_reward_that_scores_nothing_writes_nothing_and_the_cli_says_why(store, capsys):
    with pytest.raises(
        BrokenRescore, match=r"reward 'none' scored no completion of r \(.*my message.*nothing was written"
    ):
        rescore_run(store, "r", reward_specs(["none=tests.unit.reward_fns:raises_timeout"]))
    assert not (store / "rescores").exists() or not list((store / "rescores").rglob("*.parquet"))
    assert (
        main(["rescore", "r", "--reward", "t=tests.unit.reward_fns:raises_timeout", "--root", str(store)])
        == 1
    )
    assert capsys.readouterr().err.startswith("error: reward 't' scored no completion of r")
    assert main(["rescore", "r", "--reward", "correct=tests.unit.reward_fns:answer_in", "--name", "fixed",
                 "--root", str(store)]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out == ["r: rescore 'fixed' version 1, 8 cells (correct: valid 8)",
                   "what it judged otherwise: grpoflow sql --canned rescore_disagreements --run r"]  # fmt: skip


def test_bad_input_is_refused_before_anything_is_scored(store):
    for bad, why in (
        ("correct", "expected NAME=module:function"),
        ("x=tests.unit.reward_fns:no_such_fn", "--reward x:"),
    ):
        with pytest.raises(ConfigError, match=why):
            reward_specs([bad])
    with pytest.raises(ConfigError, match="a name of its own"):
        reward_specs(["a=tests.unit.reward_fns:length", "a=tests.unit.reward_fns:length"])
    with pytest.raises(ConfigError, match="no run 'nope'"):
        rescore_run(store, "nope", reward_specs(["a=tests.unit.reward_fns:length"]))
