"""The rollout explorer's API (flows/viewing/ui.py over storage/explore.py, explore_rollouts.py) on a small
store written by the store's own writers, through real HTTP (aiohttp's test server): each answer checked
against the rows written, the filters against hand-counted rows, and the safety rules (read-only, loopback
Host, API key, no file outside the static folder, SQL confined). The pages themselves run in a browser in
tests/integration/test_explorer.py."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from grpoflow.flows.viewing.ui import check_bind, make_app
from grpoflow.flows.viewing.ui_api import tokens_of
from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup, ToolCallRecord
from grpoflow.storage.rollouts import RolloutStore

pytestmark = pytest.mark.unit

RUN = "exp"
XSS = '<script>window.__xss=1</script><img src=x onerror="window.__xss=2">'


def _completion(step: int, g: int, i: int) -> RolloutCompletion:
    """Sample i of group g at `step`: reward i (valid) except sample 3, whose `acc` cell failed; sample
    2 is truncated; sample 1 made a failed tool call; sample 0 of group 1 holds markup."""
    failed = i == 3
    return RolloutCompletion(
        sample_index=i,
        completion=XSS if (g, i) == (1, 0) else f"answer {step}-{g}-{i}",
        completion_ids=[65 + i, 66, 10],
        completion_mask=[1, 0, 1],
        logprobs=[-0.5, 0.0, -2.0],
        tool_calls=[ToolCallRecord(0, "calc", '{"e": "1/0"}', "", True, "ZeroDivisionError", 0.1)]
        if i == 1
        else [],
        truncated=i == 2,
        policy_version=max(0, step - 1),
        server=f"http://127.0.0.1:{9000 + g}",
        reward=None if failed else float(i),
        reward_valid=not failed,
        invalid_reason="acc: failed: boom" if failed else None,
        reward_cells=[
            RewardCell(
                "acc", None if failed else float(i), "failed" if failed else "valid", "boom" if failed else ""
            ),
            RewardCell("fmt", 1.0, "valid", extra={"len": i}),
        ],
        advantage=float(i) - 1.0 if not failed else 0.0,
        trained=not failed,
        drop_reason="reward invalid" if failed else None,
    )


def _store(root, steps: int = 3) -> None:
    store = RolloutStore(root)
    for step in range(steps):
        groups = []
        for g in range(2):
            samples = [_completion(step, g, i) for i in range(4)]
            groups.append(
                RolloutGroup(
                    f"train-{step:04d}-{g}", g, f"prompt {g}: 2+{g}?", [1, 2], samples, row_id=f"row-{g}"
                )
            )
        store.write_rollouts(RUN, step, groups)
        store.write_rewards(RUN, step, groups)
        store.write_step(RUN, step, {"reward/mean": 1.0 + step, "reward/acc/mean": 1.0, "train/loss": 0.5 - step / 10,
                                     "train/policy_kl": 0.01, "staleness_mean": 1.0, "wall_seconds": 2.0,
                                     "reward/acc/seconds": 0.1, "gen/tokens": 24.0})  # fmt: skip
    store.write_run_meta(RUN, {"run_id": RUN, "status": "completed", "base_model": None, "config": {"a": 1}})


@pytest.fixture
async def client(tmp_path):
    _store(tmp_path)
    async with TestClient(TestServer(make_app(tmp_path))) as c:
        yield c


async def _get(client: TestClient, path: str, status: int = 200):
    resp = await client.get(path)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def test_runs_and_run_page(client):
    [run] = (await _get(client, "/api/runs"))["runs"]
    assert (run["run_id"], run["status"], run["steps"], run["last_step"], run["completions"]) == (
        RUN,
        "completed",
        3,
        2,
        24,
    )
    # valid rewards only: samples 0, 1, 2 of each group -> mean 1.0 at every step
    assert run["trend"] == [[0, 1.0], [1, 1.0], [2, 1.0]] and run["last_reward"] == 1.0

    detail = await _get(client, f"/api/run?run={RUN}")
    assert detail["reward_names"] == ["acc", "fmt"] and detail["splits"] == ["train"]
    assert detail["servers"] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert detail["has_tool_calls"] and not detail["has_eval"] and detail["config"] == {"a": 1}

    curves = await _get(client, f"/api/curves?run={RUN}")
    panels = {p["title"]: p["names"] for p in curves["panels"]}
    # per-reward timings and token counts are not curves of these panels
    assert panels == {"Reward": ["reward/acc/mean", "reward/mean"], "Loss": ["train/loss"], "KL": ["train/policy_kl"],
                      "Staleness": ["staleness_mean"], "Step time (s)": ["wall_seconds"]}  # fmt: skip
    assert curves["series"]["train/loss"] == [[0, 0.5], [1, 0.4], [2, 0.3]]

    mix = await _get(client, f"/api/status_mix?run={RUN}")
    acc = [r for r in mix["rows"] if r["reward_name"] == "acc"]
    assert [(r["step"], r["valid"], r["failed"], r["invalid"]) for r in acc] == [
        (s, 6, 2, 0) for s in range(3)
    ]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", 24),
        ("&status=failed", 6),  # sample 3 of each group
        ("&status=failed&reward_name=fmt", 0),
        ("&status=valid&reward_name=acc", 18),
        ("&truncated=1", 6),
        ("&truncated=0", 18),
        ("&tool_failed=1", 6),
        ("&step_min=1&step_max=1", 8),
        ("&reward_min=1&reward_max=2", 12),  # samples 1 and 2; the failed one has no reward
        ("&server=http://127.0.0.1:9001", 12),
        ("&text=ANSWER%201-", 7),  # case-insensitive, in the completion (step 1; one holds markup)
        ("&text=2%2B1", 12),  # in the prompt
        ("&text=%3Cscript%3E", 3),
        ("&split=eval", 0),
    ],
)
async def test_rollout_filters_count_the_matching_rows(client, query, expected):
    page = await _get(client, f"/api/rollouts?run={RUN}{query}&limit=5")
    # a text search's total is its own request (it reads every row's text)
    total = (
        page["total"]
        if "text=" not in query
        else (await _get(client, f"/api/rollouts_count?run={RUN}{query}"))["total"]
    )
    assert total == expected and page["total"] in (expected, None)
    assert len(page["rows"]) == min(expected, 5) and page["more"] == (expected > 5)


def test_a_text_search_walking_step_windows_pages_like_one_query(tmp_path):
    from grpoflow.storage import explore, explore_rollouts

    _store(tmp_path, steps=7)
    with explore.explorer_connection(tmp_path) as con:
        where, params = explore_rollouts._where(RUN, {"text": "ANSWER"})
        every = explore_rollouts._page_keys(con, where, params, 0, 100, windowed=False)
        assert len(every) == 7 * 8 - 7  # one markup completion per step
        for offset, n in ((0, 5), (3, 10), (20, 30), (45, 10), (60, 5)):
            # windows of 1, 2, 4, ... steps: a page spans several, starts mid-window, or runs past the end
            assert (
                explore_rollouts._page_keys(con, where, params, offset, n, windowed=True, width=1)
                == every[offset : offset + n]
            )


async def test_rollout_pages_and_cells(client):
    first = await _get(client, f"/api/rollouts?run={RUN}&limit=5")
    second = await _get(client, f"/api/rollouts?run={RUN}&limit=5&offset=5")
    keys = [(r["step"], r["group_id"], r["sample_index"]) for r in first["rows"] + second["rows"]]
    assert keys == sorted(keys) and len(set(keys)) == 10
    row = first["rows"][3]
    assert row["cells"] == {
        "acc": {"status": "failed", "value": None},
        "fmt": {"status": "valid", "value": 1.0},
    }
    assert (row["tool_calls"], row["tool_failures"]) == (0, 0) and first["rows"][1]["tool_failures"] == 1


async def test_rollout_group_and_compare(client):
    r = await _get(client, f"/api/rollout?run={RUN}&split=train&step=1&group=train-0001-1&sample=1")
    assert r["completion"] == "answer 1-1-1" and r["policy_version"] == 0 and r["staleness"] == 1
    assert r["tool_calls"] == [{"turn": 0, "name": "calc", "arguments": '{"e": "1/0"}', "result": "",
                                "failed": True, "error": "ZeroDivisionError", "duration_s": 0.1, "node": ""}]  # fmt: skip
    assert [(c["reward_name"], c["status"], c["extra"]) for c in r["cells"]] == [
        ("acc", "valid", None),
        ("fmt", "valid", {"len": 1}),
    ]
    # no tokenizer for this run: ids, logprobs and masks, no texts
    assert r["tokens"] == [{"id": 66, "text": None, "logprob": -0.5, "mask": 1}, {"id": 66, "text": None, "logprob": 0.0, "mask": 0},
                           {"id": 10, "text": None, "logprob": -2.0, "mask": 1}]  # fmt: skip
    assert r["tokenizer"] is None

    g = await _get(client, f"/api/group?run={RUN}&split=train&step=2&group=train-0002-0")
    # advantages 1, 0, 0 (the failed sample's), -1: highest first, ties by sample index
    assert [c["sample_index"] for c in g["completions"]] == [2, 1, 3, 0]
    assert g["completions"][0]["completion"] == "answer 2-0-2" and g["row_id"] == "row-0"
    assert g["completions"][2]["cells"]["acc"] == {"status": "failed", "value": None, "reason": "boom"}

    occ = await _get(client, "/api/occurrences?row_id=row-1")
    assert [(o["run_id"], o["step"], o["group_id"], o["completions"]) for o in occ["occurrences"]] == [
        (RUN, s, f"train-{s:04d}-1", 4) for s in range(3)]  # fmt: skip
    cmp = await _get(client, f"/api/compare?row_id=row-1&a_run={RUN}&a_step=0&b_run={RUN}&b_step=2")
    assert (cmp["a"]["group_id"], cmp["b"]["group_id"], cmp["prompt"]) == (
        "train-0000-1",
        "train-0002-1",
        "prompt 1: 2+1?",
    )


async def test_missing_and_bad_parameters_are_named(client):
    assert "step: missing" in (await _get(client, f"/api/rollout?run={RUN}&group=g&sample=0", 400))["error"]
    assert "step_min" in (await _get(client, f"/api/rollouts?run={RUN}&step_min=x", 400))["error"]
    assert "status" in (await _get(client, f"/api/rollouts?run={RUN}&status=bogus", 400))["error"]
    assert "truncated" in (await _get(client, f"/api/rollouts?run={RUN}&truncated=maybe", 400))["error"]
    assert "run: invalid run id" in (await _get(client, "/api/run?run=../etc", 400))["error"]
    assert "no run 'nope'" in (await _get(client, "/api/run?run=nope", 404))["error"]
    assert (
        "no rollout" in (await _get(client, f"/api/rollout?run={RUN}&step=9&group=g&sample=0", 404))["error"]
    )
    assert (
        "not sampled at step 7"
        in (await _get(client, f"/api/compare?row_id=row-1&a_run={RUN}&a_step=7&b_run={RUN}&b_step=0", 404))[
            "error"
        ]
    )


async def test_sql_is_read_only_and_confined(client, tmp_path):
    ok = await _get(client, "/api/sql?q=SELECT%20count(*)%20AS%20n%20FROM%20rewards")
    assert ok == {"columns": ["n"], "rows": [[48]], "row_count": 1, "truncated": False}
    canned = await _get(client, f"/api/sql?canned=invalid_rate&run={RUN}")
    assert canned["rows"][0][:3] == [RUN, "acc", 24]
    assert "read-only" in (await _get(client, "/api/sql?q=COPY%20rollouts%20TO%20'x.csv'", 400))["error"]
    assert (
        "Permission"
        in (await _get(client, "/api/sql?q=SELECT%20*%20FROM%20read_text('/etc/passwd')", 400))["error"]
    )
    assert "unknown query" in (await _get(client, "/api/sql?canned=drop", 400))["error"]
    resp = await client.get(
        "/api/sql?q=SELECT%20step,%20reward%20FROM%20rollouts%20ORDER%20BY%20ALL%20LIMIT%202&format=csv"
    )
    assert (
        resp.headers["Content-Type"].startswith("text/csv")
        and "attachment" in resp.headers["Content-Disposition"]
    )
    assert await resp.text() == "step,reward\n0,0.0\n0,0.0\n"
    assert not list(tmp_path.glob("*.csv"))


async def test_only_reads_only_named_files_only_for_localhost(client):
    for method in ("POST", "PUT", "DELETE"):
        assert (await client.request(method, "/api/runs")).status == 405
    page = await client.get("/")
    assert page.status == 200 and "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert (await client.get("/static/app.js")).headers["Content-Type"].startswith("text/javascript")
    for path in ("/static/..%2F..%2Fpyproject.toml", "/static/../ui.py", "/static/ui.py", "/runs/exp.json"):
        assert (await client.get(path)).status == 404, path
    # DNS rebinding: a page on another origin that resolves to 127.0.0.1 sends its own Host
    refused = await client.get("/api/runs", headers={"Host": "evil.example:8300"})
    assert refused.status == 403 and "script-src 'self'" in refused.headers["Content-Security-Policy"]
    assert "Content-Security-Policy" in (await client.get("/nowhere")).headers  # errors too
    assert (await client.get("/api/runs", headers={"Host": "localhost:8300"})).status == 200


async def test_an_api_key_guards_every_request(tmp_path):
    _store(tmp_path, steps=1)
    async with TestClient(TestServer(make_app(tmp_path, api_key="s3cret", loopback=False))) as c:
        assert (await c.get("/api/runs")).status == 401
        assert (await c.get("/", headers={"Authorization": "Bearer wrong"})).status == 401
        assert (await c.get("/api/runs", headers={"Authorization": "Bearer s3cret"})).status == 200
        assert (await c.get("/?key=wrong")).status == 401
        resp = await c.get("/?key=s3cret", allow_redirects=False)
        assert resp.status == 302 and "key=" not in resp.headers["Location"]
        assert (await c.get("/api/runs")).status == 200  # the cookie it set
    with pytest.raises(ValueError, match="host: binding the explorer to '0.0.0.0'.*API key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "k")
    check_bind("::1", None)


def test_token_texts_come_from_the_runs_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("héllo <b>", add_special_tokens=False)["input_ids"]
    row = {"completion_ids": ids, "completion_mask": [1] * len(ids), "logprobs": [-1.0] * len(ids)}
    tokens, source = tokens_of(dict(row), str(tiny_model_dir))
    assert source == str(tiny_model_dir)
    assert [t["text"] for t in tokens] == [tok.decode([i]) for i in ids]
    assert "".join(t["text"] for t in tokens if "\ufffd" not in t["text"]).endswith("llo <b>")
    assert tokens_of(dict(row), "/no/such/model")[0][0]["text"] is None


async def test_a_replay_and_a_rescore_beside_their_run(client, tmp_path):
    from grpoflow.storage.rescores import write_rescore

    store = RolloutStore(tmp_path)
    store.write_run_meta(
        "again", {"run_id": "again", "status": "completed", "replay_of": RUN, "replay_where": "step = 0"}
    )
    cells = [{"run_id": RUN, "split": "train", "step": 1, "group_id": "train-0001-1", "sample_index": s,
              "reward_name": "acc", "weight": 1.0, "value": v, "status": st, "reason": why, "duration_s": 0.1,
              "imputed": False, "imputed_value": None, "extra": None, "node": ""}
             for s, v, st, why in ((0, 0.5, "valid", ""), (1, None, "failed", "boom"))]  # fmt: skip
    write_rescore(tmp_path, RUN, "fixed", cells)
    runs = {r["run_id"]: r for r in (await _get(client, "/api/runs"))["runs"]}
    assert (runs["again"]["replay_of"], runs[RUN]["replay_of"]) == (RUN, None)
    assert (await _get(client, "/api/run?run=again"))["replay_of"] == RUN
    [rescore] = (await _get(client, f"/api/run?run={RUN}"))["rescores"]
    assert {k: rescore[k] for k in ("rescore", "version", "reward_name", "cells", "valid", "not_valid", "mean")} == {
        "rescore": "fixed", "version": 1, "reward_name": "acc", "cells": 2, "valid": 1, "not_valid": 1, "mean": 0.5}  # fmt: skip
    assert rescore["own_mean"] is not None  # the run's own acc, beside it
    r = await _get(client, f"/api/rollout?run={RUN}&split=train&step=1&group=train-0001-1&sample=1")
    assert [(c["rescore"], c["reward_name"], c["status"], c["reason"]) for c in r["rescored_cells"]] == [
        ("fixed", "acc", "failed", "boom")
    ]
    assert [c["reward_name"] for c in r["cells"]] == ["acc", "fmt"]  # the run's own cells, as they were
