"""The command line a person expects: --version, help on every option, Ctrl-C exits 130 and says how to
resume, bad input is one `error:` line (matched by exception type), quiet task logs unless --verbose,
and `grpoflow config show|schema|docs`."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import grpoflow.flows.cli.main as cli
import grpoflow.flows.cli.store_commands as cli_store
from grpoflow.flows.config import GRPOConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-letters.yaml"


@pytest.fixture
def no_prefect_api(monkeypatch):
    """Commands that run flows enter owned_prefect_api(); these tests never get that far."""
    import grpoflow.flows.processes.prefect_api  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import flows

    monkeypatch.setattr(flows.processes.prefect_api, "owned_prefect_api", contextlib.nullcontext)


def _parsers(parser: argparse.ArgumentParser, name: str = "grpoflow"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


@pytest.mark.unit
def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"grpoflow {importlib.metadata.version('grpoflow')}"


@pytest.mark.unit
def test_every_option_and_positional_of_every_command_has_help():
    parsers = dict(_parsers(cli.build_parser()))
    assert {"grpoflow train", "grpoflow serve", "grpoflow config show", "grpoflow make-tiny-model"} <= set(
        parsers
    )
    missing = [
        f"{name}: {'/'.join(a.option_strings) or a.dest}"
        for name, parser in parsers.items()
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert not missing, missing
    for name, parser in parsers.items():  # and every subcommand says what it is for
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in action._choices_actions}
                assert all(helps.get(sub) for sub in action.choices), (name, helps)


@pytest.mark.unit
def test_ctrl_c_returns_130_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_store, "cmd_runs", interrupted)
    assert cli.main(["runs"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def _fake_train(monkeypatch, *, begins_run: bool):
    """grpo_train that is interrupted, after writing its run's meta (as the real flow does first) or
    before."""
    import grpoflow.flows.training.train  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import flows
    from grpoflow.storage.rollouts import RolloutStore

    seen = {}

    def grpo_train(config, resume=None):
        seen["run_id"] = config.run.run_id
        if begins_run:
            RolloutStore(Path(config.storage.root)).write_run_meta(config.run.run_id, {"status": "running"})
        raise KeyboardInterrupt

    monkeypatch.setattr(flows.training.train, "grpo_train", grpo_train)
    return seen


@pytest.mark.unit
def test_ctrl_c_during_training_names_the_run_to_resume(monkeypatch, capsys, tmp_path, no_prefect_api):
    seen = _fake_train(monkeypatch, begins_run=True)
    root = tmp_path / "store"
    argv = ["train", "--root", str(root), "--set", "run.steps=3", "--set", "learner.lr=0.5"]
    assert cli.main(argv) == 130
    run_id = seen["run_id"]
    assert run_id  # named by the CLI before the flow starts, so the message can name it
    err = capsys.readouterr().err
    assert err == (
        f"interrupted; resume with grpoflow train --set run.steps=3 --set learner.lr=0.5 "
        f"--root {root} --resume {run_id}\n"
    )
    # and that command parses back to the same config, resuming that run
    again = cli.build_parser().parse_args(err.split("resume with grpoflow ")[1].split())
    assert again.resume == run_id and again.set == ["run.steps=3", "learner.lr=0.5"]


@pytest.mark.unit
def test_ctrl_c_before_the_run_began_says_only_interrupted(monkeypatch, capsys, tmp_path, no_prefect_api):
    _fake_train(monkeypatch, begins_run=False)
    assert cli.main(["train", "--root", str(tmp_path / "store")]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.unit
def test_config_error_is_one_line(capsys):
    assert cli.main(["config", "show", str(TINY), "--set", "learner.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "learner.lr" in err and "Traceback" not in err


@pytest.mark.unit
def test_refused_query_is_one_line(capsys, tmp_path):
    assert cli.main(["sql", "--root", str(tmp_path), "DELETE FROM rollouts"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "read-only" in err


@pytest.mark.unit
def test_bad_run_id_is_one_line_before_any_flow_runs(capsys, tmp_path, monkeypatch, no_prefect_api):
    import grpoflow.flows.viewing.report  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import flows

    monkeypatch.setattr(
        flows.viewing.report, "grpo_report_flow", lambda: pytest.fail("the flow must not run")
    )
    assert cli.main(["report", "../outside", "--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: invalid run id '../outside'")


@pytest.mark.unit
def test_serving_off_loopback_without_a_key_is_one_line(capsys, monkeypatch, no_prefect_api):
    import grpoflow.flows.processes.policy_server  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import flows

    monkeypatch.delenv("GRPOFLOW_API_KEY", raising=False)
    monkeypatch.setattr(
        flows.processes.policy_server, "policy_server", lambda **kw: pytest.fail("the flow must not run")
    )
    assert cli.main(["serve", "--model", "m", "--host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err.startswith("error: --host 0.0.0.0: refusing to serve off loopback")


@pytest.mark.unit
@pytest.mark.parametrize("drain", ["soon", "-1", "inf"])
def test_a_bad_prefect_drain_is_one_line_before_the_command_runs(drain, capsys, monkeypatch, tmp_path):
    """GRPOFLOW_PREFECT_DRAIN_S bounds a command's wait for a configured Prefect API that stopped
    answering (flows/processes/prefect_api.py); a value that is no number of seconds fails at the start,
    not at the exit of a run that already trained."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import grpoflow.flows.viewing.report  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import flows
    from grpoflow.flows.processes.prefect_api import exit_drain_s

    monkeypatch.setattr(
        flows.viewing.report, "grpo_report_flow", lambda: pytest.fail("the command must not run")
    )
    monkeypatch.setenv("GRPOFLOW_PREFECT_DRAIN_S", "2.5")
    assert exit_drain_s() == 2.5
    monkeypatch.setenv("GRPOFLOW_PREFECT_DRAIN_S", drain)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # never contacted
        assert cli.main(["report", "run", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: GRPOFLOW_PREFECT_DRAIN_S={drain!r}: must be a number of seconds, 0 or more\n"


@pytest.mark.unit
def test_other_errors_keep_their_traceback(monkeypatch):
    def bug(args):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(cli_store, "cmd_runs", bug)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["runs"])


@pytest.mark.unit
def test_config_show_is_the_resolved_tree_with_descriptions(capsys):
    assert cli.main(["config", "show", str(TINY), "--set", "run.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "  lr: 0.01\n" in out  # from the file
    assert "  max_grad_norm: 1.0\n" in out  # a default the file does not set
    assert "  steps: 7\n" in out  # the override
    assert "  # Peak learning rate (AdamW).\n  lr: 0.01\n" in out
    assert "# Reward functions (at least one).\nrewards:\n" in out
    assert yaml.safe_load(out) == load_config(TINY, ["run.steps=7"]).model_dump()


@pytest.mark.unit
def test_config_show_without_a_file_is_the_tiny_demo(capsys):
    assert cli.main(["config", "show"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == load_config(TINY).model_dump()


@pytest.mark.unit
def test_config_schema_names_every_section(capsys):
    assert cli.main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == set(GRPOConfig.model_fields)
    assert {"ModelConfig", "RewardConfig", "LearnerConfig", "RunConfig"} <= set(schema["$defs"])


@pytest.mark.unit
def test_config_docs_prints_the_reference(capsys):
    from grpoflow.flows.config_docs import render_markdown

    assert cli.main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render_markdown()


# A real flow with two tasks, run through main() the way `grpoflow report` runs its flow: Prefect's
# own INFO lines of every task run stay off the terminal unless --verbose, but still reach the API.
PROBE = textwrap.dedent(
    """
    import asyncio, sys
    from prefect import flow, get_run_logger, task
    from prefect.runtime import flow_run

    import grpoflow.flows.cli.main as cli
    import grpoflow.flows.cli.flow_commands as cli_flows
    from grpoflow.flows.processes.prefect_api import owned_prefect_api

    runs = {}

    @task
    def one():
        get_run_logger().info("task info line")
        return 1

    @task
    def two(x):
        get_run_logger().warning("task warning line")
        return x + 1

    @flow
    def tiny(name):
        runs[name] = flow_run.id
        get_run_logger().info("flow info line")
        return two(one())

    @flow
    def interrupted():
        raise KeyboardInterrupt

    def fake_report(args):
        interrupted() if args.run == "ctrl-c" else tiny(args.run)
        return 0

    async def api_logs(flow_run_id):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        async with get_client() as client:
            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [log.message for log in logs if log.task_run_id is not None]

    cli_flows.cmd_report = fake_report
    with owned_prefect_api():  # one API server for all three commands
        for argv in (["report", "quiet"], ["report", "loud", "--verbose"], ["report", "ctrl-c"]):
            print(f"=== {argv[1]}", file=sys.stderr, flush=True)
            print(f"=== rc {cli.main(argv)}", file=sys.stderr, flush=True)
        print("API", sorted(asyncio.run(api_logs(runs["quiet"]))))
    import os, tempfile
    print("LEFT", sorted(os.listdir(tempfile.gettempdir())))
    """
)


@pytest.mark.unit
@pytest.mark.integration  # starts Prefect's temporary API server (about 10 s)
def test_task_run_info_lines_only_with_verbose_in_a_real_flow(tmp_path):
    (tmp_path / "tmp").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env={
            **{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "TMPDIR": str(tmp_path / "tmp"),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # the API server's log (there for a failed start) goes with a clean exit
    left = out.stdout.split("LEFT ", 1)[1].splitlines()[0]
    assert "grpoflow-prefect-api" not in left, left
    parts = out.stderr.split("=== ")  # "", "quiet\n...", "rc 0\n", "loud\n...", "rc 0\n", ...
    quiet, loud, ctrl_c = parts[1], parts[3], parts[5]
    assert quiet.startswith("quiet") and loud.startswith("loud") and ctrl_c.startswith("ctrl-c")
    assert [parts[2].split()[:2], parts[4].split()[:2], parts[6].split()[:2]] == [
        ["rc", "0"],
        ["rc", "0"],
        ["rc", "130"],
    ]
    # quiet: the flow's lines and task warnings, no task INFO
    assert "flow info line" in quiet and "task warning line" in quiet
    assert "Task run" not in quiet.replace("WARNING | Task run", "")
    assert "task info line" not in quiet
    assert "Flow run" in quiet and "Finished in state Completed()" in quiet  # the flow's own line
    # --verbose: every task's lines
    assert loud.count("Finished in state Completed()") == 3 and "task info line" in loud
    # Ctrl-C inside a flow: one line (after the flow's own crash report), exit 130
    assert ctrl_c.rstrip().endswith("\ninterrupted") and "Traceback" not in ctrl_c
    # the API (the UI) still got the task runs' INFO lines of the quiet run
    api = out.stdout.split("API ", 1)[1]
    assert "task info line" in api and "Finished in state Completed()" in api


def test_a_closed_pipe_is_not_an_error():
    """`grpoflow config schema | head`: the reader leaves early; no traceback, exit 0."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m grpoflow.flows.cli.main config schema | true"  # the reader is gone before any write
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr


@pytest.mark.unit
def test_retrain_passes_the_gate_to_the_flow(monkeypatch, tmp_path, capsys):
    # The flow itself runs in tests/integration/test_promotion.py; here, what the command hands it.
    import grpoflow.flows.lineage.retrain  # noqa: F401  (binds the package; its attribute is used)
    from grpoflow import flows

    seen = {}

    def fake(**kw):
        seen.update(kw)
        decision = {"decision": "rejected", "reason": "r"}
        return {"decision": decision, "eval": {"reward_mean": 0.1}, "incumbent_eval": {"reward_mean": 0.2}}

    monkeypatch.setattr(flows.lineage.retrain, "grpo_retrain", fake)
    args = cli.build_parser().parse_args(["retrain", "--lineage", "prod", "--steps", "3", "--server", "http://h:1",
                                          "--metric", "pass_rate", "--margin", "0.05", "--root", str(tmp_path)])  # fmt: skip
    assert args.fn(args) == 0
    assert seen["lineage"] == "prod" and seen["extra_steps"] == 3 and seen["server_url"] == "http://h:1"
    assert seen["gate_metric"] == "pass_rate" and seen["gate_margin"] == 0.05
    assert seen["config"].storage.root == str(tmp_path)
    assert json.loads(capsys.readouterr().out)["decision"] == "rejected"


@pytest.mark.unit
def test_serve_needs_a_model_or_a_lineage_with_a_promotion(tmp_path, capsys):
    assert cli.main(["serve", "--root", str(tmp_path)]) == 2
    assert "give --model DIR or --lineage L" in capsys.readouterr().err
    assert cli.main(["serve", "--lineage", "prod", "--root", str(tmp_path)]) == 2
    assert "--lineage prod: no promotion recorded" in capsys.readouterr().err
