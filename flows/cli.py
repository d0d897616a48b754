"""`grpoflow` command line: train, retrain, promote, rollback, serve, evaluate, sql, runs, compact, export,
report, config, make-tiny-model."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import shlex
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-letters.yaml"
FORMATS = ["table", "csv", "json"]
ROOT_HELP = "store root (default: $GRPOFLOW_ROOT or ./runs)"
VERBOSE_HELP = "also show Prefect's INFO lines of every task run (e.g. 'Finished in state Completed()')"


def _root(args) -> str:
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


def _config(args, *more: str):
    """The config of `--config` (default: the tiny demo's) with `--set`, `--root` and `more` applied."""
    from grpoflow.flows.config import load_config

    overrides = list(args.set or [])
    if args.root or os.environ.get("GRPOFLOW_ROOT"):
        overrides.append(f"storage.root={_root(args)}")
    config_path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    return load_config(config_path, overrides + list(more))


def cmd_train(args) -> int:
    cfg = _config(args, *([f"run.run_id={args.run_id}"] if args.run_id else []))
    from grpoflow.flows.runs import new_run_id, preflight

    preflight(cfg, args.resume)  # bad input: one clear line, before a flow run or a model exists
    if args.resume is None and cfg.run.run_id is None:
        cfg.run.run_id = new_run_id()  # named here, so that an interrupted run can be named to resume
    args.interrupted_run = (cfg.storage.root, args.resume or cfg.run.run_id)
    from grpoflow.flows.prefect_api import owned_prefect_api
    from grpoflow.flows.train import grpo_train

    quiet_prefect_task_logs(not args.verbose)
    with owned_prefect_api():  # Prefect's temporary API server dies with this process
        summary = grpo_train(config=cfg, resume=args.resume)
    print(
        f"run {summary['run_id']}: {summary['steps_trained']} steps, reward "
        f"{summary['first_reward']} -> {summary['last_reward']}; store {summary['store']}"
    )
    return 0


def cmd_sql(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.storage.sql import CANNED, format_result, query

    if args.canned:
        if args.canned not in CANNED:
            raise ConfigError(f"unknown canned query {args.canned!r}; choose from {sorted(CANNED)}")
        cols, rows = query(_root(args), CANNED[args.canned], {"run": args.run})
    elif args.query:
        cols, rows = query(_root(args), _sql_text(args.query))
    else:
        raise ConfigError("give a query, @file.sql, or --canned NAME")
    print(format_result(cols, rows, args.format))
    return 0


def _sql_text(arg: str) -> str:
    """The query itself, or the text of the file `@file.sql` names."""
    from grpoflow.flows.config import ConfigError

    if not arg.startswith("@"):
        return arg
    try:
        return Path(arg[1:]).read_text()
    except OSError as e:
        raise ConfigError(f"{arg}: cannot read the query file: {e.strerror}") from None


def cmd_runs(args) -> int:
    from grpoflow.storage.sql import format_result, list_runs

    cols, rows = list_runs(_root(args))
    print(format_result(cols, rows, args.format))
    return 0


def cmd_export(args) -> int:
    from grpoflow.flows.export import export_checkpoint

    done = export_checkpoint(_root(args), args.run, args.out, args.step, args.merge)
    what = {"model": "model", "adapter": "LoRA adapter (PEFT)", "merged": "merged model"}[done.kind]
    print(f"{args.run} step {done.step}: {what} -> {done.out}")
    return 0


def cmd_compact(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.storage.compact import compact_store
    from grpoflow.storage.layout import StoreLayoutError
    from grpoflow.storage.records import validate_run_id
    from grpoflow.storage.rollouts import RolloutStore

    if args.every is not None and args.every < 1:
        raise ConfigError(f"--every: must be an integer >= 1, got {args.every}")
    runs = RolloutStore(_root(args)).runs()
    if args.run and validate_run_id(args.run) not in runs:
        raise ConfigError(f"RUN: no run {args.run!r} under {_root(args)}")
    if not runs:
        print(f"no runs under {_root(args)}")
        return 0
    try:
        results = compact_store(_root(args), args.run, args.every)
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


def check_serve(args) -> None:
    """`serve`'s bad input, refused before the Prefect API starts (one line, no traceback)."""
    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.serve import is_loopback

    if not args.api_key and not is_loopback(args.host):
        raise ConfigError(
            f"--host {args.host}: refusing to serve off loopback without an API key; give --api-key "
            "or set GRPOFLOW_API_KEY (the default 127.0.0.1 needs none)"
        )
    if not args.model and not args.lineage:
        raise ConfigError("serve: give --model DIR or --lineage L (the lineage's promoted weights)")
    from grpoflow.storage.records import validate_run_id

    for lineage in args.lineage or []:
        validate_run_id(lineage)  # a bad id is its own one-line error
    if args.lora_rank is not None:
        from grpoflow.flows.policy_server import lora_lineages

        try:
            lora_lineages(_root(args), args.lineage or [], args.model)
        except ValueError:
            raise ConfigError(
                f"--lineage {' '.join(args.lineage or [])}: no LoRA promotion recorded under {_root(args)} to "
                "take the base model from; give --model BASE"
            ) from None
        return
    if args.lineage and len(args.lineage) > 1:
        raise ConfigError(
            "serve: several --lineage share one server only as LoRA adapters: give --lora-rank R"
        )
    if args.lineage:
        from grpoflow.flows.policy_server import served_model_dir

        try:
            served_model_dir(_root(args), args.lineage[0], args.model)
        except ValueError:
            raise ConfigError(
                f"--lineage {args.lineage[0]}: no promotion recorded under {_root(args)}; give --model"
            ) from None


def cmd_serve(args) -> int:
    from grpoflow.flows.policy_server import policy_server

    lora = args.lora_rank is not None
    policy_server(
        model_dir=args.model,
        lineage=None if lora or not args.lineage else args.lineage[0],
        lineages=args.lineage if lora else None,
        lora_rank=args.lora_rank,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        root=_root(args),
    )
    return 0


def cmd_retrain(args) -> int:
    import json

    from grpoflow.flows.retrain import grpo_retrain

    cfg = _config(args)
    out = grpo_retrain(lineage=args.lineage, extra_steps=args.steps, config=cfg, eval_prompts=args.eval_prompts,
                       server_url=args.server, gate_metric=args.metric, gate_margin=args.margin,
                       eval_greedy=args.greedy)  # fmt: skip
    d = out["decision"]
    print(json.dumps({"decision": d["decision"], "reason": d["reason"], "eval": out["eval"],
                      "incumbent_eval": out["incumbent_eval"]}, default=str))  # fmt: skip
    return 0


def _server_inference(args):
    from grpoflow.tasks.config.inference import InferenceConfig

    return InferenceConfig(api_key=args.api_key) if args.api_key else InferenceConfig()


def cmd_promote(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.promote import base_version, checkpoint_version, promote, serving_version
    from grpoflow.storage.promotions import PromotionError
    from grpoflow.storage.records import validate_run_id
    from grpoflow.tasks.push.push import WeightPushError

    root, run = _root(args), validate_run_id(args.run)
    lineage = validate_run_id(args.lineage or run)
    try:
        candidate = checkpoint_version(root, run, args.step)
        incumbent = serving_version(root, lineage) or base_version(root, run)
        row = promote(root, lineage, candidate, incumbent=incumbent, server_url=args.server,
                      inference=_server_inference(args), reason=args.reason)  # fmt: skip
    except (PromotionError, WeightPushError) as e:
        raise ConfigError(str(e)) from None
    print(
        f"{lineage}: promoted {run} step {row['serving_step']}"
        + (f" into {args.server}" if args.server else "")
    )
    return 0


def cmd_rollback(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.promote import rollback
    from grpoflow.storage.promotions import PromotionError
    from grpoflow.storage.records import validate_run_id
    from grpoflow.tasks.push.push import WeightPushError

    try:
        row = rollback(_root(args), validate_run_id(args.lineage), server_url=args.server,
                       inference=_server_inference(args))  # fmt: skip
    except (PromotionError, WeightPushError) as e:
        raise ConfigError(str(e)) from None
    print(f"{args.lineage}: {row['reason']}" + (f" on {args.server}" if args.server else ""))
    return 0


def cmd_evaluate(args) -> int:
    import json

    from grpoflow.flows.evaluate import grpo_evaluate
    from grpoflow.storage.records import validate_run_id

    cfg = _config(args)
    if args.run:
        validate_run_id(args.run)  # before the flow run: a bad id is one line, not a failed flow run
    result = grpo_evaluate(config=cfg, run_id=args.run, checkpoint=args.checkpoint, prompts=args.prompts,
                           greedy=args.greedy, server_url=args.server)  # fmt: skip
    print(json.dumps(result))
    return 0


def cmd_report(args) -> int:
    from grpoflow.flows.report import grpo_report_flow
    from grpoflow.storage.records import validate_run_id

    validate_run_id(args.run)  # before the flow run: a bad id is one line, not a failed flow run

    print(grpo_report_flow()(run_id=args.run, root=_root(args), out_dir=args.out))
    return 0


def cmd_compare(args) -> int:
    from grpoflow.flows.compare import identical, report
    from grpoflow.storage.records import validate_run_id

    for run in (args.run_a, args.run_b):
        validate_run_id(run)
    return 0 if identical(report(_root(args), args.run_a, args.run_b)) else 1


def cmd_ui(args) -> int:
    import asyncio

    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.ui import check_bind, serve

    try:
        check_bind(args.host, args.api_key or os.environ.get("GRPOFLOW_UI_API_KEY"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not Path(_root(args)).is_dir():
        raise ConfigError(f"--root: {_root(args)!r} is not a directory (a store written by grpoflow train)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve(
                _root(args),
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpoflow", description="Async GRPO as Prefect flows.")
    version = f"grpoflow {importlib.metadata.version('grpoflow')}"
    p.add_argument("--version", action="version", version=version, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    _flow_commands(sub)
    _store_commands(sub)
    return p


def _config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: configs/tiny-letters.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")


def _live_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help="live policy server to load the version into (default: record only)")
    p.add_argument("--api-key", default=os.environ.get("GRPOFLOW_API_KEY"),
                   help="bearer key of --server (default: $GRPOFLOW_API_KEY)")  # fmt: skip
    p.add_argument("--root", help=ROOT_HELP)
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def _flow_commands(sub) -> None:
    """The commands that run a Prefect flow: train, serve, evaluate, report."""
    t = sub.add_parser("train", help="run grpo-train (no arguments: the tiny demo)")
    _config_options(t)
    t.add_argument("--resume", metavar="RUN", help="continue RUN from its latest checkpoint")
    t.add_argument("--run-id", help="name of a new run (default: generated)")
    t.add_argument("--root", help=ROOT_HELP)
    t.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("serve", help="start and supervise a vLLM server (policy-server flow)")
    v.add_argument(
        "--model", help="model directory (with --lineage: served until the lineage has a promotion)"
    )
    v.add_argument(
        "--lineage",
        action="append",
        help="serve what this lineage's promotion log says it serves (with --lora-rank: repeat it; each "
        "lineage's adapter is served under its name, --model is the base)",
    )
    v.add_argument(
        "--lora-rank",
        type=int,
        help="start the server on the base model with LoRA adapters up to this rank loadable at runtime, "
        "shared by LoRA lineages (promote/rollback --server swap their adapters by name)",
    )
    v.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1; others need a key)")
    v.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    key_help = "bearer key every request must carry (default: $GRPOFLOW_API_KEY)"
    v.add_argument("--api-key", default=os.environ.get("GRPOFLOW_API_KEY"), help=key_help)
    v.add_argument("--root", help="store root; the server's pid file goes to <root>/pids/")
    v.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    v.set_defaults(fn=cmd_serve, runs_flows=True, precheck=check_serve)

    e = sub.add_parser(
        "evaluate", help="run grpo-evaluate: score a run's latest checkpoint (or the base model)"
    )
    _config_options(e)
    e.add_argument("--run", help="evaluate this run's latest checkpoint (default: the config's base model)")
    e.add_argument("--checkpoint", help="evaluate this checkpoint directory instead")
    e.add_argument(
        "--prompts",
        type=int,
        help="at most this many eval rows (default: the eval split, else the last 16 rows)",
    )
    e.add_argument("--server", help="evaluate on this server (its weights are replaced; default: its own)")
    e.add_argument("--greedy", action="store_true", help="one completion per prompt at temperature 0")
    e.add_argument("--root", help=ROOT_HELP)
    e.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    e.set_defaults(fn=cmd_evaluate, runs_flows=True)

    rt = sub.add_parser(
        "retrain", help="run grpo-retrain: train a lineage N more steps, promote it only if better"
    )
    _config_options(rt)
    rt.add_argument("--lineage", required=True, help="the lineage (a run id) to continue")
    rt.add_argument("--steps", type=int, default=10, help="steps to train (default: 10)")
    rt.add_argument("--server", help="live policy server the promoted weights go into")
    rt.add_argument("--metric", default="reward_mean", choices=("reward_mean", "pass_rate", "valid_frac"),
                    help="gate metric (default: reward_mean)")  # fmt: skip
    rt.add_argument("--margin", type=float, default=0.0, help="the candidate must beat the incumbent by more")
    rt.add_argument("--eval-prompts", type=int, help="at most this many eval rows (default: the eval split)")
    rt.add_argument("--greedy", action="store_true", help="evaluate one greedy completion per row")
    rt.add_argument("--root", help=ROOT_HELP)
    rt.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    rt.set_defaults(fn=cmd_retrain, runs_flows=True)

    pr = sub.add_parser("promote", help="serve a run's checkpoint: load it into --server and record it")
    pr.add_argument("run", help="run id")
    pr.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    pr.add_argument("--lineage", help="lineage recorded (default: the run id)")
    pr.add_argument("--reason", default="manual promotion", help="recorded with the decision")
    _live_server_options(pr)
    pr.set_defaults(fn=cmd_promote, runs_flows=True)

    rb = sub.add_parser("rollback", help="serve a lineage's previous promoted version again")
    rb.add_argument("lineage", help="lineage (run id)")
    _live_server_options(rb)
    rb.set_defaults(fn=cmd_rollback, runs_flows=True)

    rp = sub.add_parser("report", help="PNG plots + markdown summary of a run (also a Prefect artifact)")
    rp.add_argument("run", help="run id (see `grpoflow runs`)")
    rp.add_argument("--root", help=ROOT_HELP)
    rp.add_argument("--out", help="output folder (default: <root>/reports/<run>)")
    rp.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    rp.set_defaults(fn=cmd_report, runs_flows=True)


def _store_commands(sub) -> None:
    """The commands that read the store or the config: sql, runs, compact, export, config, make-tiny-model."""
    s = sub.add_parser("sql", help="read-only SQL over rollouts, rewards, steps, tool_calls, promotions")
    s.add_argument("query", nargs="?", help="SQL text, or @file.sql to read it from a file")
    s.add_argument(
        "--canned", help="a canned query: reward_curve, invalid_rate, tool_failures, lengths, promotions"
    )
    s.add_argument("--run", help="restrict a canned query to one run (promotions: one lineage)")
    s.add_argument("--root", help=ROOT_HELP)
    s.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    s.set_defaults(fn=cmd_sql)

    u = sub.add_parser("ui", help="the rollout explorer: runs, curves, rollouts, groups and SQL in a browser")
    u.add_argument("--root", help=ROOT_HELP)
    u.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: loopback; others need --api-key)"
    )
    u.add_argument("--port", type=int, default=8300, help="port (default: 8300; 0 picks a free one)")
    u.add_argument("--api-key", help="key browsers must send (default: $GRPOFLOW_UI_API_KEY)")
    u.set_defaults(fn=cmd_ui)

    r = sub.add_parser("runs", help="list runs in the store")
    r.add_argument("--root", help=ROOT_HELP)
    r.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    r.set_defaults(fn=cmd_runs)

    cm = sub.add_parser(
        "compare", help="did a rerun reproduce? two runs compared bit for bit, first difference"
    )
    cm.add_argument("run_a", help="run id")
    cm.add_argument("run_b", help="run id")
    cm.add_argument("--root", help=ROOT_HELP)
    cm.set_defaults(fn=cmd_compare)

    k = sub.add_parser("compact", help="merge runs' closed steps into few Parquet files (SQL gets faster)")
    k.add_argument("run", nargs="?", help="run id (default: every run in the store)")
    k.add_argument("--every", type=int,
                   help="compaction unit in steps (default: the run's storage.compact_every, else 100)")  # fmt: skip
    k.add_argument("--root", help=ROOT_HELP)
    k.set_defaults(fn=cmd_compact)

    e = sub.add_parser("export", help="a run's checkpoint as a model dir (or LoRA adapter) other tools load")
    e.add_argument("run", help="run id")
    e.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    e.add_argument("--merge", action="store_true",
                   help="LoRA runs: merge the adapter into the base model (a standalone model dir)")  # fmt: skip
    e.add_argument("--out", required=True, help="output directory (new, or empty)")
    e.add_argument("--root", help=ROOT_HELP)
    e.set_defaults(fn=cmd_export)

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

    m = sub.add_parser("make-tiny-model", help="build the tiny random model + tokenizer")
    m.add_argument("dir", help="output directory")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    m.set_defaults(fn=cmd_make_tiny_model)


def main(argv: list[str] | None = None) -> int:
    # Prefect's ephemeral server would try to send telemetry; keep local runs quiet and offline.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args = build_parser().parse_args(argv)
    from grpoflow.flows.config import ConfigError
    from grpoflow.storage.records import InvalidRunIdError
    from grpoflow.storage.sql import QueryError
    from grpoflow.tasks.push.push import LoraUnsupportedError
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError

    try:
        if not getattr(args, "runs_flows", False):
            return args.fn(args)
        if getattr(args, "precheck", None):
            args.precheck(args)
        from grpoflow.flows.prefect_api import owned_prefect_api

        quiet_prefect_task_logs(not args.verbose)
        with owned_prefect_api():  # Prefect's temporary API server dies with this process
            return args.fn(args)
    except (ConfigError, QueryError, InvalidRunIdError, LoraUnsupportedError) as e:
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
