"""The rollout explorer in a real browser: `grpoflow ui` over a copy of the fault drill's store (a real run
through the real vLLM server: failed, invalid and timed-out reward cells, tool calls that fail), driven
by headless Debian Chromium through selenium and chromedriver. Every figure the pages show is checked
against the same rows read with SQL; a completion holding markup, written into the store, shows as
its characters and runs nothing. Screenshots of each page land in test-artifacts/explorer/."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from tests.support import need_browser

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "explorer"
XSS = '<script>window.__xss=1</script><img src=x onerror="window.__xss=2"> & <b>bold</b>'
FAILED_CELL = """EXISTS (SELECT 1 FROM rewards w WHERE w.run_id = r.run_id AND w.split = r.split AND w.step = r.step
                 AND w.group_id = r.group_id AND w.sample_index = r.sample_index AND w.status = 'failed')"""


def _browser(profile: Path):
    webdriver = pytest.importorskip("selenium.webdriver")
    need_browser("chromium", "chromedriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1400,900"):  # fmt: skip
        opts.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=opts, service=service)


class Page:
    """The explorer in one browser tab: navigate, wait until the page says it rendered, read it."""

    def __init__(self, driver, url: str):
        self.d, self.url = driver, url

    def _settled(self, before, error: bool = False) -> None:
        """Run `before` (a click, a navigation), then wait until the page says it rendered (or, with
        `error`, that it shows an error)."""
        from selenium.webdriver.support.ui import WebDriverWait

        def ready(d):
            state = d.execute_script(
                "const s = document.getElementById('page-status'); return s && s.dataset.state"
            )
            if state == ("ready" if error else "error"):
                raise AssertionError("the page reported: " + d.find_element("id", "page-status").text)
            return state == ("error" if error else "ready")

        self.d.execute_script("document.getElementById('page-status').dataset.state = 'stale'")
        before()
        WebDriverWait(self.d, 30, 0.05).until(ready)

    def go(self, hash_route: str) -> None:
        if not self.d.current_url.startswith(self.url):
            self.d.get(self.url)
            from selenium.webdriver.support.ui import WebDriverWait

            WebDriverWait(self.d, 30).until(
                lambda d: d.execute_script("return !!document.getElementById('page-status')")
            )
        self._settled(lambda: self.d.execute_script("location.hash = arguments[0]", hash_route))

    def click(self, css: str, within=None, error: bool = False) -> None:
        target = (within or self.d).find_element("css selector", css)
        self._settled(target.click, error)

    def all(self, css: str):
        return self.d.find_elements("css selector", css)

    def text(self, css: str) -> str:
        return self.d.execute_script("return document.querySelector(arguments[0]).textContent", css)

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.d.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def _xss_run(root: Path) -> str:
    """A run whose one completion and reward reason are markup, written as a run writes its rows."""
    cells = [RewardCell("judge", None, "failed", reason=XSS)]
    c = RolloutCompletion(0, XSS, [60, 115], [1, 1], [-0.5, -1.0], reward_cells=cells, invalid_reason=XSS)
    group = RolloutGroup("train-xss", 0, f"prompt {XSS}", [1], [c], row_id="xss")
    store = RolloutStore(root)
    store.write_rollouts("xss-run", 0, [group])
    store.write_rewards("xss-run", 0, [group])
    store.write_run_meta("xss-run", {"run_id": "xss-run", "status": "completed"})
    return group.group_id


def _live_step(root: Path, step: int) -> None:
    """One step of a run that is `running`, owned by this (live) process, as a run writes it."""
    from grpoflow.storage.processes import identity

    c = RolloutCompletion(0, f"step {step}", [60], [1], [-0.5], reward=float(step), reward_valid=True)
    group = RolloutGroup(f"train-live-{step}", step, "prompt", [1], [c], row_id="live")
    store = RolloutStore(root)
    store.write_rollouts("live", step, [group])
    store.write_rewards("live", step, [group])
    store.write_run_meta("live", {"run_id": "live", "status": "running", "owner": identity()})


def _rescore_and_replay(root: Path) -> None:
    """The drill run rescored by a length reward (`lengths`), and replayed for two steps (`chaos-again`)."""
    from grpoflow.flows.lineage.replay import grpo_replay
    from grpoflow.flows.lineage.rescore import rescore_run, reward_specs

    rescore_run(root, "chaos", reward_specs(["length=tests.unit.reward_fns:length"]), name="lengths")
    grpo_replay(run="chaos", sets=["run.steps=2"], replay_id="chaos-again", root=str(root))


@pytest.fixture
def explorer(chaos_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(chaos_store[0], root)
    proc = subprocess.Popen([sys.executable, "-m", "grpoflow.flows.cli.main", "ui", "--root", str(root), "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("rollout explorer at http://localhost:"), line
        yield root, line.split()[3]
    finally:
        proc.terminate()
        proc.wait(10)


def test_browse_a_fault_drill_run(explorer, tmp_path):
    root, url = explorer
    xss_group = _xss_run(root)
    _rescore_and_replay(root)
    driver = _browser(tmp_path / "profile")
    try:
        p = Page(driver, url)

        # Runs: both runs listed; open the drill's run page.
        p.go("#/")
        assert {"chaos", "xss-run"} <= {r.text.split()[0] for r in p.all("#runs-table tbody tr")}
        p.shot("runs")
        p.click("#runs-table a[href='#/run/chaos']")
        assert "chaos" in p.text("#run-title")
        titles = {s.get_attribute("data-title") for s in p.all("#curves svg.chart")}
        assert {"Reward", "Loss", "Step time (s)"} <= titles, titles
        mix = p.text("#status-mix")
        assert "letters" in mix and "judge" in mix and len(p.all("#status-mix svg")) >= 2
        p.shot("run")

        # Rollouts filtered to failed reward cells: the count and the first page are the store's.
        p.go("#/run/chaos/rollouts")
        from selenium.webdriver.support.ui import Select

        Select(driver.find_element("css selector", "#filters [name=status]")).select_by_value("failed")
        p.click("#apply-filters")
        _, [(failed,)] = query(
            root,
            f"SELECT count(*) FROM rollouts r WHERE run_id = 'chaos' AND split = 'train' AND {FAILED_CELL}",
        )
        assert failed > 0 and int(p.text("#rollout-total").split()[0].replace(",", "")) == failed
        _, first = query(root, f"""SELECT step, group_id, sample_index FROM rollouts r
                                   WHERE run_id = 'chaos' AND split = 'train' AND {FAILED_CELL}
                                   ORDER BY step, group_id, sample_index LIMIT 50""")  # fmt: skip
        shown = [(int(r.get_attribute("data-step")), r.get_attribute("data-group"), int(r.get_attribute("data-sample")))
                 for r in p.all("#rollouts-table tbody tr")]  # fmt: skip
        assert shown == first
        p.shot("rollouts-failed")

        # A rollout with tool calls and a failed cell, opened from its step's filtered list.
        _, [(step, group, sample, completion, n_tokens, masked, n_calls)] = query(root, f"""
            SELECT step, group_id, sample_index, completion, completion_tokens,
                   len(list_filter(completion_mask, lambda m: m = 0)), len(tool_calls)
            FROM rollouts r WHERE run_id = 'chaos' AND split = 'train' AND len(tool_calls) > 0 AND {FAILED_CELL}
            ORDER BY step, group_id, sample_index LIMIT 1""")  # fmt: skip
        p.go(f"#/run/chaos/rollouts?status=failed&step_min={step}&step_max={step}")
        row = driver.find_element(
            "css selector", f"#rollouts-table tbody tr[data-group='{group}'][data-sample='{sample}']"
        )
        p.click("a.open-rollout", within=row)
        assert p.text("#completion-text") == completion
        _, calls = query(root, f"""SELECT tc.name, tc.arguments FROM (SELECT unnest(tool_calls) AS tc FROM rollouts
                                   WHERE run_id = 'chaos' AND step = {step} AND group_id = '{group}'
                                   AND sample_index = {sample})""")  # fmt: skip
        call_rows = p.all("#tool-calls-table tbody tr")
        assert len(call_rows) == n_calls == len(calls)
        for tr, (name, args) in zip(call_rows, calls, strict=True):
            assert name in tr.text and args in tr.get_attribute("textContent")
        _, cells = query(root, f"""SELECT reward_name, status FROM rewards WHERE run_id = 'chaos' AND step = {step}
                                   AND group_id = '{group}' AND sample_index = {sample} ORDER BY ALL""")  # fmt: skip
        shown_cells = sorted((tr.get_attribute("data-reward"), tr.get_attribute("data-status"))
                             for tr in p.all("#reward-cells-table tbody tr"))  # fmt: skip
        assert shown_cells == cells and ("letters", "failed") in shown_cells
        assert len(p.all("#tokens .tok")) == n_tokens and len(p.all("#tokens .tok.masked")) == masked > 0
        p.shot("rollout")

        # Its group: the G completions side by side, highest advantage first.
        p.click(f"a[href^='#/group/chaos/train/{step}/']")
        cols = p.all("#group-columns .group-col")
        advantages = [float(c.get_attribute("data-advantage")) for c in cols]
        assert len(cols) == 8 and advantages == sorted(advantages, reverse=True)
        p.shot("group")

        # Compare: one prompt row at two steps of the run (its 16 rows come round every two steps).
        _, [(row_id, a_step, b_step)] = query(root, """
            SELECT row_id, min(step), max(step) FROM rollouts WHERE run_id = 'chaos' AND split = 'train'
            GROUP BY row_id HAVING count(DISTINCT step) > 1 ORDER BY row_id LIMIT 1""")  # fmt: skip
        p.go(f"#/compare?row_id={row_id}&a_run=chaos&a_step={a_step}&b_run=chaos&b_step={b_step}")
        for side, s in (("#compare-a", a_step), ("#compare-b", b_step)):
            _, texts = query(
                root,
                f"SELECT completion FROM rollouts WHERE run_id = 'chaos' AND step = {s} AND row_id = '{row_id}'",
            )
            shown_text = p.text(side)
            assert len(texts) == 8 and all(t in shown_text for (t,) in texts), side
        p.shot("compare")

        # SQL: a free query's table and its CSV download; a write is refused in the error box.
        sql = "SELECT reward_name, status, count(*) AS n FROM rewards GROUP BY ALL ORDER BY ALL"
        p.go("#/sql")
        driver.find_element("id", "sql-text").clear()
        driver.find_element("id", "sql-text").send_keys(sql)
        p.click("#sql-run")
        cols, rows = query(root, sql)
        shown_rows = [
            [td.text for td in tr.find_elements("css selector", "td")] for tr in p.all("#sql-result tbody tr")
        ]
        assert shown_rows == [[str(v) for v in r] for r in rows]
        with urllib.request.urlopen(driver.find_element("id", "sql-csv").get_attribute("href")) as resp:
            csv_text = resp.read().decode()
        assert csv_text.splitlines() == [",".join(cols)] + [",".join(map(str, r)) for r in rows]
        p.shot("sql")
        driver.find_element("id", "sql-text").clear()
        driver.find_element("id", "sql-text").send_keys("DELETE FROM rollouts")
        p.click("#sql-run", error=True)
        assert "read-only" in p.text("#sql-error")

        # Rollouts as data: a replay beside its source run, a rescore beside the run's own rewards.
        p.go("#/")
        replay_row = driver.find_element("css selector", "#runs-table tr[data-run='chaos-again']")
        assert "replay of chaos" in replay_row.text
        p.click("a[href='#/run/chaos-again']")
        assert p.text("#replay-of") == "chaos"
        p.click("#replay-of")
        assert "chaos" in p.text("#run-title")
        shown = [(tr.get_attribute("data-rescore"), tr.get_attribute("data-reward"), tr.text.split()[3:6])
                 for tr in p.all("#rescores-table tbody tr")]  # fmt: skip
        _, [(n,)] = query(
            root, "SELECT count(*) FROM rollouts WHERE run_id = 'chaos'"
        )  # a cell each, all valid
        assert shown == [("lengths", "length", [str(n), str(n), "0"])], shown
        p.go(f"#/rollout/chaos/train/{step}/{group}/{sample}")
        rescored = [tr.get_attribute("data-reward") for tr in p.all("#rescored-cells-table tbody tr")]
        assert rescored == ["length"], rescored
        p.shot("rescores")

        # Markup in a completion, its prompt and a reward reason is text: shown as written, never run.
        p.go(f"#/rollout/xss-run/train/0/{xss_group}/0")
        assert p.text("#completion-text") == XSS
        assert any(XSS in tr.get_attribute("textContent") for tr in p.all("#reward-cells-table tbody tr"))
        p.go("#/run/xss-run/rollouts")
        assert XSS[:40] in p.text("#rollouts-table")
        p.go(f"#/group/xss-run/train/0/{xss_group}")
        assert XSS in p.text("#group-columns")
        p.shot("xss")
        assert driver.execute_script("return window.__xss") is None
        # no element was made from it: no image, no inline script, no <b> holding its "bold"
        made = "[...document.querySelectorAll('img, script:not([src]), b')].filter(e => e.tagName !== 'B' || e.textContent === 'bold')"
        assert driver.execute_script(f"return {made}.length") == 0

        # A running run's row updates as its steps land, without a reload.
        from selenium.webdriver.support.ui import WebDriverWait

        _live_step(root, 0)
        p.go("#/")
        steps = lambda: driver.execute_script(  # noqa: E731
            "const r = document.querySelector(\"#runs-table tr[data-run='live']\"); "
            "return r && [r.cells[1].textContent, r.cells[2].textContent]"
        )
        assert steps() == ["running", "1"]
        _live_step(root, 1)
        WebDriverWait(driver, 30, 0.2).until(lambda d: steps() == ["running", "2"])
    finally:
        driver.quit()
