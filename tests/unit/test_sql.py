"""DuckDB views and canned queries over real Parquet files; read-only enforcement; the CLI."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.flows.cli.main import main as cli
from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup, ToolCallRecord
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import CANNED, QueryError, ReadOnlyQueryError, query, run_canned

pytestmark = pytest.mark.unit
GRPOFLOW = str(Path(sys.executable).with_name("grpoflow"))  # the installed script a user runs


def comp(i, reward, valid, tokens, tools=(), truncated=False, cells=()):
    return RolloutCompletion(
        sample_index=i,
        completion="x" * tokens,
        completion_ids=[1] * tokens,
        completion_mask=[1] * tokens,
        logprobs=[-1.0] * tokens,
        reward=reward,
        reward_valid=valid,
        truncated=truncated,
        tool_calls=[ToolCallRecord(0, name, "{}", "", failed) for name, failed in tools],
        reward_cells=[RewardCell(n, v, s) for n, v, s in cells],
    )


@pytest.fixture
def store(tmp_path):
    s = RolloutStore(tmp_path)
    # step 0: rewards 1.0 and 0.0 valid, one invalid (None) -> mean over valid = 0.5, valid_frac 2/3
    g0 = RolloutGroup(
        "g0",
        0,
        "p",
        [0],
        [
            comp(
                0,
                1.0,
                True,
                4,
                tools=[("calc", False), ("calc", True)],
                cells=[("acc", 1.0, "valid"), ("fmt", None, "failed")],
            ),
            comp(1, 0.0, True, 6, cells=[("acc", 0.0, "valid"), ("fmt", 1.0, "valid")]),
            comp(
                2,
                None,
                False,
                2,
                truncated=True,
                tools=[("search", True)],
                cells=[("acc", None, "invalid"), ("fmt", None, "timeout")],
            ),
        ],
    )
    # step 1: rewards 0.25 and 0.75 -> mean 0.5... and 1.0 -> mean of [0.25, 0.75, 1.0] = 2/3
    g1 = RolloutGroup(
        "g1", 1, "p", [0], [comp(0, 0.25, True, 3), comp(1, 0.75, True, 3), comp(2, 1.0, True, 9)]
    )
    for step, g in enumerate([g0, g1]):
        s.write_rollouts("r1", step, [g])
        s.write_rewards("r1", step, [g])
    s.write_rollouts("r2", 0, [RolloutGroup("h", 0, "p", [0], [comp(0, 5.0, True, 1)])])
    return tmp_path


@pytest.mark.parametrize("name", sorted(CANNED))
def test_every_canned_query_runs_on_an_empty_store(tmp_path, name):
    cols, rows = run_canned(tmp_path, name)
    assert cols and rows == []


def test_reward_curve_counts_valid_completions_only(store):
    _, rows = run_canned(store, "reward_curve", "r1")
    (r0, r1) = rows
    assert r0[:3] == ("r1", 0, 0.5) and r0[4] == pytest.approx(2 / 3) and r0[5] == 3
    assert r1[2] == pytest.approx(2 / 3) and r1[4] == 1.0
    _, all_runs = run_canned(store, "reward_curve")
    assert {r[0] for r in all_runs} == {"r1", "r2"}


def test_invalid_rate_per_reward(store):
    rows = {r[1]: r for r in run_canned(store, "invalid_rate", "r1")[1]}
    # acc: 6 cells (3 + 3 with no cells in step 1? no: step-1 completions have no cells) -> 3 cells
    assert rows["acc"][2:] == (3, pytest.approx(1 / 3), 1, 0, 0)  # one invalid of three
    assert rows["fmt"][2:] == (3, pytest.approx(2 / 3), 0, 1, 1)  # one failed, one timeout


def test_tool_failure_rate(store):
    rows = {r[1]: r for r in run_canned(store, "tool_failures", "r1")[1]}
    assert rows["calc"][2:] == (2, 1, 0.5) and rows["search"][2:] == (1, 1, 1.0)


def test_lengths(store):
    rows = run_canned(store, "lengths", "r1")[1]
    # step 0 tokens [4, 6, 2]: mean 4, min 2, max 6, median 4, truncated 1/3
    assert rows[0][2:] == (4.0, 2, 6, 4.0, pytest.approx(1 / 3))


@pytest.mark.parametrize(
    "sql",
    [
        "CREATE TABLE t AS SELECT 1",
        "COPY rollouts TO '/tmp/x.csv'",
        "INSERT INTO t VALUES (1)",
        "ATTACH 'x.db'",
        "INSTALL httpfs",
        "SET threads = 1",
        "SELECT 1; DROP VIEW rollouts",
        "PRAGMA version",
    ],
)
def test_write_queries_are_refused(store, sql):
    with pytest.raises(ReadOnlyQueryError, match="refused"):
        query(store, sql)


def test_cli_sql_and_runs(store, capsys):
    assert (
        cli(
            [
                "sql",
                "--root",
                str(store),
                "--format",
                "json",
                "SELECT run_id, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out) == [{"run_id": "r1", "n": 6}, {"run_id": "r2", "n": 1}]
    assert (
        cli(["sql", "--root", str(store), "--canned", "reward_curve", "--run", "r2", "--format", "csv"]) == 0
    )
    assert capsys.readouterr().out.splitlines()[1].startswith("r2,0,5.0")
    assert cli(["sql", "--root", str(store), "DELETE FROM rollouts"]) == 2
    assert "read-only" in capsys.readouterr().err
    assert cli(["runs", "--root", str(store)]) == 0
    out = capsys.readouterr().out
    assert "r1" in out and "r2" in out


def test_a_bad_query_is_one_error_line_and_exit_2_from_the_real_cli(store):
    out = subprocess.run([GRPOFLOW, "sql", "--root", str(store), "SELECT * FROM nosuch"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: Catalog Error: Table with name nosuch does not exist")
    assert out.stderr.count("\n") == 1, out.stderr  # one line: no traceback, no query excerpt


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("SELEC 1", 'cannot parse query: Parser Error: syntax error at or near "SELEC"'),
        ("SELECT nosuch FROM rollouts", 'Binder Error: Referenced column "nosuch" not found'),
        ("SELECT 'a'::INT", "Conversion Error: Could not convert string 'a' to INT32"),
        ("@missing.sql", "@missing.sql: cannot read the query file: No such file or directory"),
    ],
)
def test_every_bad_query_is_one_error_line(store, capsys, sql, message):
    assert cli(["sql", "--root", str(store), sql]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_a_failed_query_raises_duckdbs_message_for_the_flow(store):
    """rollout-sql calls `query`: its run fails with this error."""
    with pytest.raises(QueryError, match="^Catalog Error: Table with name nosuch does not exist"):
        query(store, "SELECT * FROM nosuch")


def test_csv_lines_end_with_a_newline_a_shell_can_compare(store):
    sql = "SELECT run_id, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1"
    out = subprocess.run([GRPOFLOW, "sql", "--root", str(store), "--format", "csv", sql],
                         capture_output=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout == b"run_id,n\nr1,6\nr2,1\n"
    # the shell idiom that a "\r" at the end of each line broke
    script = f"n=$({GRPOFLOW} sql --root {shlex.quote(str(store))} --format csv {shlex.quote(sql)} | tail -1)"
    script += '; [[ ${n#*,} -gt 0 ]] && echo "ok ${n#*,}"'
    shell = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert shell.stdout == "ok 1\n", shell.stderr


OUTSIDE = [
    "SELECT count(*) FROM read_text('{secret}')",
    "SELECT count(*) FROM read_csv('{secret}')",
    "SELECT count(*) FROM read_parquet('{parquet}')",
    "SELECT count(*) FROM glob('{outside}/*')",
    "SELECT count(*) FROM read_text('{store}/../secret.txt')",
    "SELECT count(*) FROM read_text('{store}/link/secret.txt')",  # a symlink inside the store
]


@pytest.mark.parametrize("sql", OUTSIDE)
def test_queries_read_nothing_outside_the_store(store, tmp_path_factory, sql):
    """DuckDB's table functions are SELECTs, so a statement filter lets them through: the connection's
    own external-access settings are what refuse them."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_text("top secret\n")
    (store.parent / "secret.txt").write_text("top secret\n")
    parquet = next((store / "rollouts").rglob("*.parquet"))
    copy = outside / "copy.parquet"
    copy.write_bytes(parquet.read_bytes())
    (store / "link").symlink_to(outside)
    q = sql.format(secret=outside / "secret.txt", parquet=copy, outside=outside, store=store)
    with pytest.raises(Exception, match="Permission Error|disabled by configuration"):
        query(store, q)
    _, rows = query(store, "SELECT count(*) FROM rollouts")  # the store's views still answer
    assert rows[0][0] > 0


@pytest.mark.parametrize(
    "statement",
    ["SET enable_external_access = true", "RESET enable_external_access", "SET allowed_directories = ['/']",
     "RESET allowed_directories", "SET lock_configuration = false"],
)  # fmt: skip
def test_the_confinement_cannot_be_undone_on_the_connection_itself(store, tmp_path_factory, statement):
    from grpoflow.storage.sql import connect

    secret = tmp_path_factory.mktemp("outside") / "secret.txt"
    secret.write_text("top secret\n")
    con = connect(store)
    try:
        with pytest.raises(Exception, match="configuration"):
            con.execute(statement)
        with pytest.raises(Exception, match="Permission Error|disabled by configuration"):
            con.execute(f"SELECT * FROM read_text('{secret}')").fetchall()
    finally:
        con.close()


def test_tool_calls_say_where_they_ran_and_files_from_before_that_read_as_null(tmp_path):
    """A file written before tool calls had `node` (its struct lacks the field), alone and beside a new one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    s = RolloutStore(tmp_path)
    old = RolloutGroup("o", 0, "p", [0], [comp(0, 1.0, True, 2, tools=[("calc", False)])])
    s.write_rollouts("old", 0, [old])
    (path,) = (tmp_path / "rollouts").rglob("*.parquet")
    t = pq.read_table(path)
    i = t.schema.get_field_index("tool_calls")
    legacy = pa.list_(pa.struct([f for f in t.schema.field(i).type.value_type if f.name != "node"]))
    pq.write_table(t.set_column(i, "tool_calls", t.column(i).cast(legacy)), path)
    assert query(tmp_path, "SELECT name, node FROM tool_calls")[1] == [("calc", None)]
    new = comp(0, 1.0, True, 2)
    new.tool_calls = [ToolCallRecord(0, "calc", "{}", "", False, node="10.0.0.7")]
    s.write_rollouts("new", 0, [RolloutGroup("n", 0, "p", [0], [new])])
    assert query(tmp_path, "SELECT run_id, node FROM tool_calls ORDER BY run_id")[1] == [
        ("new", "10.0.0.7"),
        ("old", None),
    ]
