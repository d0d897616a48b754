"""The `grpoflow` commands that read the store or the config (sql, ui, runs, compare, compact, export,
config, make-tiny-model): each command's function and its parser."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from grpoflow.flows.cli.shared import DEFAULT_CONFIG, FORMATS, ROOT_HELP, sql_text, store_root


def cmd_sql(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.storage.sql import CANNED, format_result, query

    if args.canned:
        if args.canned not in CANNED:
            raise ConfigError(f"unknown canned query {args.canned!r}; choose from {sorted(CANNED)}")
        cols, rows = query(store_root(args), CANNED[args.canned], {"run": args.run})
    elif args.query:
        cols, rows = query(store_root(args), sql_text(args.query))
    else:
        raise ConfigError("give a query, @file.sql, or --canned NAME")
    print(format_result(cols, rows, args.format))
    return 0


def cmd_runs(args) -> int:
    from grpoflow.storage.sql import format_result, list_runs

    cols, rows = list_runs(store_root(args))
    print(format_result(cols, rows, args.format))
    return 0


def cmd_export(args) -> int:
    from grpoflow.flows.lineage.export import export_checkpoint

    done = export_checkpoint(store_root(args), args.run, args.out, args.step, args.merge)
    what = {"model": "model", "adapter": "LoRA adapter (PEFT)", "merged": "merged model"}[done.kind]
    print(f"{args.run} step {done.step}: {what} -> {done.out}")
    return 0


def cmd_compact(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.storage.compact import compact_store
    from grpoflow.storage.ids import validate_run_id
    from grpoflow.storage.layout import StoreLayoutError
    from grpoflow.storage.rollouts import RolloutStore

    if args.every is not None and args.every < 1:
        raise ConfigError(f"--every: must be an integer >= 1, got {args.every}")
    runs = RolloutStore(store_root(args)).runs()
    if args.run and validate_run_id(args.run) not in runs:
        raise ConfigError(f"RUN: no run {args.run!r} under {store_root(args)}")
    if not runs:
        print(f"no runs under {store_root(args)}")
        return 0
    try:
        results = compact_store(store_root(args), args.run, args.every)
    except StoreLayoutError as e:  # a store changed by hand: say where, without a traceback
        raise ConfigError(str(e)) from None
    for r in results:
        if "skipped" in r:
            print(f"{r['run_id']}: skipped: {r['skipped']}")
            continue
        files = ", ".join(
            f"{t} {r[t]['files_before']} -> {r[t]['files_after']}"
            for t in ("rollouts", "rewards", "steps")
            if t in r
        )
        print(f"{r['run_id']}: closed through step {r['upto']}: files {files or 'none'} ({r['seconds']} s)")
    return 0


def cmd_compare(args) -> int:
    from grpoflow.flows.viewing.compare import identical, report
    from grpoflow.storage.ids import validate_run_id

    for run in (args.run_a, args.run_b):
        validate_run_id(run)
    return 0 if identical(report(store_root(args), args.run_a, args.run_b)) else 1


def cmd_ui(args) -> int:
    import asyncio

    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.viewing.ui import check_bind, serve

    try:
        check_bind(args.host, args.api_key or os.environ.get("GRPOFLOW_UI_API_KEY"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not Path(store_root(args)).is_dir():
        raise ConfigError(
            f"--root: {store_root(args)!r} is not a directory (a store written by grpoflow train)"
        )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve(
                store_root(args),
                args.host,
                args.port,
                args.api_key,
                ready=lambda url: print(f"rollout explorer at {url} (Ctrl+C stops it)", flush=True),
            )
        )
    return 0


def cmd_make_tiny_model(args) -> int:
    from grpoflow.tasks.tiny_model import build_tiny_model

    print(build_tiny_model(args.dir, seed=args.seed))
    return 0


def cmd_config_show(args) -> int:
    from grpoflow.flows.config import load_config
    from grpoflow.flows.config_docs import render_yaml

    config_path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    print(render_yaml(load_config(config_path, args.set)), end="")
    return 0


def cmd_config_schema(args) -> int:
    import json

    from grpoflow.flows.config import GRPOConfig

    print(json.dumps(GRPOConfig.model_json_schema(), indent=2))
    return 0


def cmd_config_docs(args) -> int:
    from grpoflow.flows.config_docs import DOCS_PATH, render_markdown

    text = render_markdown()
    if args.write:
        DOCS_PATH.write_text(text)
        print(f"wrote {DOCS_PATH}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def add_store_commands(sub) -> None:
    """The commands that read the store or the config: sql, ui, runs, compare, compact, export, config,
    make-tiny-model."""
    for add in (
        _sql_parser,
        _ui_parser,
        _runs_parser,
        _compare_parser,
        _compact_parser,
        _export_parser,
        _config_parser,
        _make_tiny_model_parser,
    ):
        add(sub)


def _sql_parser(sub) -> None:
    s = sub.add_parser("sql", help="read-only SQL over rollouts, rewards, steps, tool_calls, promotions")
    s.add_argument("query", nargs="?", help="SQL text, or @file.sql to read it from a file")
    s.add_argument(
        "--canned", help="a canned query: reward_curve, invalid_rate, tool_failures, lengths, promotions"
    )
    s.add_argument("--run", help="restrict a canned query to one run (promotions: one lineage)")
    s.add_argument("--root", help=ROOT_HELP)
    s.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    s.set_defaults(fn=cmd_sql)


def _ui_parser(sub) -> None:
    u = sub.add_parser("ui", help="the rollout explorer: runs, curves, rollouts, groups and SQL in a browser")
    u.add_argument("--root", help=ROOT_HELP)
    u.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: loopback; others need --api-key)"
    )
    u.add_argument("--port", type=int, default=8300, help="port (default: 8300; 0 picks a free one)")
    u.add_argument("--api-key", help="key browsers must send (default: $GRPOFLOW_UI_API_KEY)")
    u.set_defaults(fn=cmd_ui)


def _runs_parser(sub) -> None:
    r = sub.add_parser("runs", help="list runs in the store")
    r.add_argument("--root", help=ROOT_HELP)
    r.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    r.set_defaults(fn=cmd_runs)


def _compare_parser(sub) -> None:
    cm = sub.add_parser(
        "compare", help="did a rerun reproduce? two runs compared bit for bit, first difference"
    )
    cm.add_argument("run_a", help="run id")
    cm.add_argument("run_b", help="run id")
    cm.add_argument("--root", help=ROOT_HELP)
    cm.set_defaults(fn=cmd_compare)


def _compact_parser(sub) -> None:
    k = sub.add_parser("compact", help="merge runs' closed steps into few Parquet files (SQL gets faster)")
    k.add_argument("run", nargs="?", help="run id (default: every run in the store)")
    k.add_argument(
        "--every",
        type=int,
        help="compaction unit in steps (default: the run's storage.compact_every, else 100)",
    )
    k.add_argument("--root", help=ROOT_HELP)
    k.set_defaults(fn=cmd_compact)


def _export_parser(sub) -> None:
    e = sub.add_parser("export", help="a run's checkpoint as a model dir (or LoRA adapter) other tools load")
    e.add_argument("run", help="run id")
    e.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    e.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: merge the adapter into the base model (a standalone model dir)",
    )
    e.add_argument("--out", required=True, help="output directory (new, or empty)")
    e.add_argument("--root", help=ROOT_HELP)
    e.set_defaults(fn=cmd_export)


def _config_parser(sub) -> None:
    c = sub.add_parser("config", help="show a resolved config, its JSON schema, or the reference docs")
    csub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION", help="one of:")
    cs = csub.add_parser("show", help="the resolved config as YAML, each field's description as a comment")
    cs.add_argument("config", nargs="?", help="YAML config (default: configs/tiny-letters.yaml)")
    cs.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    cs.set_defaults(fn=cmd_config_show)
    csub.add_parser("schema", help="the JSON schema of the config tree").set_defaults(fn=cmd_config_schema)
    cd = csub.add_parser("docs", help="docs/configuration.md: a table per config section")
    cd.add_argument("--write", action="store_true", help="write docs/configuration.md instead of printing it")
    cd.set_defaults(fn=cmd_config_docs)


def _make_tiny_model_parser(sub) -> None:
    m = sub.add_parser("make-tiny-model", help="build the tiny random model + tokenizer")
    m.add_argument("dir", help="output directory")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    m.set_defaults(fn=cmd_make_tiny_model)
