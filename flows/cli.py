"""`grpoflow` command line: train, serve, sql, runs, make-tiny-model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-letters.yaml"


def _root(args) -> str:
    return args.root or os.environ.get("GRPOFLOW_ROOT") or "runs"


def cmd_train(args) -> int:
    from flows.config import load_config

    overrides = list(args.set or [])
    if args.root or os.environ.get("GRPOFLOW_ROOT"):
        overrides.append(f"storage.root={_root(args)}")
    if args.run_id:
        overrides.append(f"run.run_id={args.run_id}")
    config_path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    cfg = load_config(config_path, overrides)
    from flows.runs import preflight

    preflight(cfg, args.resume)  # bad input: one clear line, before a flow run or a model exists
    from flows.prefect_api import owned_prefect_api
    from flows.train import grpo_train

    with owned_prefect_api():  # Prefect's temporary API server dies with this process
        summary = grpo_train(config=cfg, resume=args.resume)
    print(
        f"run {summary['run_id']}: {summary['steps_trained']} steps, reward "
        f"{summary['first_reward']} -> {summary['last_reward']}; store {summary['store']}"
    )
    return 0


def cmd_sql(args) -> int:
    from storage.sql import CANNED, format_result, query

    if args.canned:
        if args.canned not in CANNED:
            print(f"unknown canned query {args.canned!r}; choose from {sorted(CANNED)}", file=sys.stderr)
            return 2
        cols, rows = query(_root(args), CANNED[args.canned], {"run": args.run})
    elif args.query:
        sql = Path(args.query[1:]).read_text() if args.query.startswith("@") else args.query
        cols, rows = query(_root(args), sql)
    else:
        print("give a query, @file.sql, or --canned NAME", file=sys.stderr)
        return 2
    print(format_result(cols, rows, args.format))
    return 0


def cmd_runs(args) -> int:
    from storage.sql import format_result, list_runs

    cols, rows = list_runs(_root(args))
    print(format_result(cols, rows, args.format))
    return 0


def cmd_serve(args) -> int:
    from flows.serve import policy_server

    policy_server(
        model_dir=args.model, host=args.host, port=args.port, api_key=args.api_key, root=_root(args)
    )
    return 0


def cmd_report(args) -> int:
    from flows.report import grpo_report_flow

    print(grpo_report_flow()(run_id=args.run, root=_root(args), out_dir=args.out))
    return 0


def cmd_make_tiny_model(args) -> int:
    from tasks.tiny_model import build_tiny_model

    print(build_tiny_model(args.dir, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpoflow", description="Async GRPO as Prefect flows.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run grpo-train (no arguments: the tiny demo)")
    t.add_argument("--config", help="YAML config (default: configs/tiny-letters.yaml)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    t.add_argument("--resume", metavar="RUN", help="continue RUN from its latest checkpoint")
    t.add_argument("--run-id", help="name of a new run")
    t.add_argument("--root", help="store root (default: $GRPOFLOW_ROOT or ./runs)")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sql", help="read-only SQL over rollouts, rewards, steps, tool_calls")
    s.add_argument("query", nargs="?", help="SQL text, or @file.sql")
    s.add_argument("--canned", help="a canned query: reward_curve, invalid_rate, tool_failures, lengths")
    s.add_argument("--run", help="restrict a canned query to one run")
    s.add_argument("--root")
    s.add_argument("--format", choices=["table", "csv", "json"], default="table")
    s.set_defaults(fn=cmd_sql)

    r = sub.add_parser("runs", help="list runs in the store")
    r.add_argument("--root")
    r.add_argument("--format", choices=["table", "csv", "json"], default="table")
    r.set_defaults(fn=cmd_runs)

    v = sub.add_parser("serve", help="start and supervise a vLLM server (policy-server flow)")
    v.add_argument("--model", required=True, help="model directory")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=os.environ.get("GRPOFLOW_API_KEY"))
    v.add_argument("--root", help="store root; the server's pid file goes to <root>/pids/")
    v.set_defaults(fn=cmd_serve, runs_flows=True)

    rp = sub.add_parser("report", help="PNG plots + markdown summary of a run (also a Prefect artifact)")
    rp.add_argument("run")
    rp.add_argument("--root")
    rp.add_argument("--out", help="output folder (default: <root>/reports/<run>)")
    rp.set_defaults(fn=cmd_report, runs_flows=True)

    m = sub.add_parser("make-tiny-model", help="build the tiny random model + tokenizer")
    m.add_argument("dir")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    # Prefect's ephemeral server would try to send telemetry; keep local runs quiet and offline.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args = build_parser().parse_args(argv)
    from flows.config import ConfigError

    try:
        if not getattr(args, "runs_flows", False):
            return args.fn(args)
        from flows.prefect_api import owned_prefect_api

        with owned_prefect_api():  # Prefect's temporary API server dies with this process
            return args.fn(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # refused queries, bad run ids: one clear line, no traceback
        if type(e).__name__ in {"ReadOnlyQueryError", "ValueError"}:
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
