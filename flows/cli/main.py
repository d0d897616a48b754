"""`grpoflow` command line: train, retrain, promote, rollback, serve, evaluate, sql, runs, compact, export,
dataset, rescore, replay, report, config, make-tiny-model.

The entry point (pyproject's console script, `python -m grpoflow.flows.cli.main`): the parser and `main`,
which runs a command and turns bad input and Ctrl-C into one line. The commands live in flow_commands.py
(those that run a Prefect flow), store_commands.py (those that read the store or the config) and
data_commands.py (stored rollouts as data: dataset, rescore, replay)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shlex
import sys
import traceback
from pathlib import Path

from grpoflow.flows.cli.data_commands import add_data_commands
from grpoflow.flows.cli.flow_commands import add_flow_commands
from grpoflow.flows.cli.shared import quiet_prefect_task_logs
from grpoflow.flows.cli.store_commands import add_store_commands


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpoflow", description="Async GRPO as Prefect flows.")
    version = f"grpoflow {importlib.metadata.version('grpoflow')}"
    p.add_argument("--version", action="version", version=version, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    add_flow_commands(sub)
    add_store_commands(sub)
    add_data_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
    except BaseException:  # a bug's traceback, but never an exit that waits on a dead Prefect API
        if _undelivered() is None:
            raise
        traceback.print_exc()
        code = 1
    if stuck := _undelivered():  # Prefect would wait at exit for an API that does not answer
        print(f"warning: {stuck}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _undelivered() -> str | None:
    api = sys.modules.get("grpoflow.flows.processes.prefect_api")  # imported by the commands that run flows
    return api.undelivered() if api is not None else None


def _main(argv: list[str] | None) -> int:
    # Prefect's ephemeral server would try to send telemetry; keep local runs quiet and offline.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args = build_parser().parse_args(argv)
    from grpoflow.flows.config import ConfigError
    from grpoflow.storage.ids import InvalidRunIdError
    from grpoflow.storage.sql import QueryError
    from grpoflow.tasks.push.push import LoraUnsupportedError, TransportError
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError

    try:
        if not getattr(args, "runs_flows", False):
            return args.fn(args)
        if getattr(args, "precheck", None):
            args.precheck(args)
        from grpoflow.flows.processes.prefect_api import owned_prefect_api

        quiet_prefect_task_logs(not args.verbose)
        with owned_prefect_api():  # Prefect's temporary API server dies with this process
            return args.fn(args)
    except (ConfigError, QueryError, InvalidRunIdError, LoraUnsupportedError, TransportError) as e:
        # Bad input: one clear line, no traceback. Any other error is a bug and keeps its traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenRewardError as e:  # the user's reward, not grpoflow: one line, the run resumable
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted_message(args), file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    except BrokenPipeError:  # `grpoflow sql ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def interrupted_message(args) -> str:
    """'interrupted', plus how to resume when a training run was interrupted after it began."""
    root, run_id = getattr(args, "interrupted_run", (None, None))
    if run_id is None:
        return "interrupted"
    with contextlib.suppress(Exception):  # the message must never fail: then it stays plain
        from grpoflow.storage.rollouts import RolloutStore

        if RolloutStore(Path(root)).read_run_meta(run_id) is not None:
            again = ["grpoflow", "train"]
            again += ["--config", args.config] if args.config else []
            for item in args.set or []:
                again += ["--set", item]
            again += ["--root", args.root] if args.root else []
            return f"interrupted; resume with {shlex.join([*again, '--resume', run_id])}"
    return "interrupted"


if __name__ == "__main__":
    sys.exit(main())
