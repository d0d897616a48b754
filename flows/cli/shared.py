"""What the `grpoflow` command modules share: the default config, the store root, the config a command
runs on (`--config`, `--set`, `--root`), the options' common help, and the terminal's quiet Prefect
task-run logs (also used by scripts and benchmarks that run flows)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-letters.yaml"
FORMATS = ["table", "csv", "json"]
ROOT_HELP = "store root (default: $GRPOFLOW_ROOT or ./runs)"
VERBOSE_HELP = "also show Prefect's INFO lines of every task run (e.g. 'Finished in state Completed()')"


def store_root(args) -> str:
    return args.root or os.environ.get("GRPOFLOW_ROOT") or "runs"


class _TaskRunInfoFilter(logging.Filter):
    """Keeps task runs' INFO (and lower) lines off the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        task_run = record.name == "prefect.task_runs" or record.name.startswith("prefect.task_runs.")
        return record.levelno >= logging.WARNING or not task_run


_TASK_RUN_INFO = _TaskRunInfoFilter()


def quiet_prefect_task_logs(quiet: bool = True) -> None:
    """Hide (or show again) Prefect's per-task INFO lines on the terminal: every task of every step
    logs 'Finished in state Completed()'; and transformers' progress bars. Only the console handler filters them: task runs, their
    states and their logs still reach the Prefect API (the UI), and flow-run lines (the one line per
    step) still show. Task-run warnings and errors always show."""
    import prefect  # noqa: F401  (importing Prefect sets up its logging: the console handler on root)
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            (handler.addFilter if quiet else handler.removeFilter)(_TASK_RUN_INFO)
    # transformers' per-call progress bars ("Loading weights", "Writing model shards") at every load,
    # push and checkpoint: the same noise, off unless --verbose.
    from transformers.utils import logging as hf_logging

    (hf_logging.disable_progress_bar if quiet else hf_logging.enable_progress_bar)()


def cli_config(args, *more: str):
    """The config of `--config` (default: the tiny demo's) with `--set`, `--root` and `more` applied."""
    from grpoflow.flows.config import load_config

    overrides = list(args.set or [])
    if args.root or os.environ.get("GRPOFLOW_ROOT"):
        overrides.append(f"storage.root={store_root(args)}")
    config_path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    return load_config(config_path, overrides + list(more))


def sql_text(arg: str) -> str:
    """The query itself, or the text of the file `@file.sql` names."""
    from grpoflow.flows.config import ConfigError

    if not arg.startswith("@"):
        return arg
    try:
        return Path(arg[1:]).read_text()
    except OSError as e:
        raise ConfigError(f"{arg}: cannot read the query file: {e.strerror}") from None
