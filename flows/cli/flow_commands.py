"""The `grpoflow` commands that run a Prefect flow (train, serve, evaluate, retrain, promote, rollback,
report): each command's function and its parser."""

from __future__ import annotations

import argparse
from typing import get_args

from grpoflow.flows.cli.shared import (
    ROOT_HELP,
    VERBOSE_HELP,
    cli_config,
    quiet_prefect_task_logs,
    store_root,
)
from grpoflow.tasks.config.choices import GateMetric
from grpoflow.tasks.config.inference import api_key_from_env


def cmd_train(args) -> int:
    cfg = cli_config(args, *([f"run.run_id={args.run_id}"] if args.run_id else []))
    from grpoflow.flows.training.preflight import preflight, preflighted
    from grpoflow.flows.training.runs import new_run_id

    if args.resume is None and cfg.run.run_id is None:
        cfg.run.run_id = new_run_id()  # named here, so that an interrupted run can be named to resume
    rows = preflight(cfg, args.resume)  # bad input: one clear line, before a flow run or a model exists
    args.interrupted_run = (cfg.storage.root, args.resume or cfg.run.run_id)
    from grpoflow.flows.processes.prefect_api import (
        completed_without_api,
        owned_prefect_api,
        settle_flow_runs,
    )
    from grpoflow.flows.training.train import grpo_train

    quiet_prefect_task_logs(not args.verbose)
    with owned_prefect_api() as own_url:  # Prefect's temporary API server dies with this process
        if own_url is None:  # a configured API may still show runs that ended while it was down
            settle_flow_runs(cfg.storage.root)
        try:
            with preflighted(cfg, args.resume, rows):  # the flow's own preflight: checked just now
                summary = grpo_train(config=cfg, resume=args.resume)
        except Exception as e:  # a Prefect API that died after the run's last step: the run is complete
            if (done := completed_without_api(cfg.storage.root, args.interrupted_run[1], e)) is None:
                raise
            print(done)
            return 0
    print(
        f"run {summary['run_id']}: {summary['steps_trained']} steps, reward "
        f"{summary['first_reward']} -> {summary['last_reward']}; store {summary['store']}"
    )
    return 0


def check_serve(args) -> None:
    """`serve`'s bad input, refused before the Prefect API starts (one line, no traceback)."""
    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.processes.launch import is_loopback

    if not args.api_key and not is_loopback(args.host):
        raise ConfigError(
            f"--host {args.host}: refusing to serve off loopback without an API key; give --api-key "
            "or set GRPOFLOW_API_KEY (the default 127.0.0.1 needs none)"
        )
    if not args.model and not args.lineage:
        raise ConfigError("serve: give --model DIR or --lineage L (the lineage's promoted weights)")
    from grpoflow.storage.ids import validate_run_id

    for lineage in args.lineage or []:
        validate_run_id(lineage)  # a bad id is its own one-line error
    if args.lora_rank is not None:
        from grpoflow.flows.processes.policy_server import lora_lineages

        try:
            lora_lineages(store_root(args), args.lineage or [], args.model)
        except ValueError:
            raise ConfigError(
                f"--lineage {' '.join(args.lineage or [])}: no LoRA promotion recorded under {store_root(args)} to "
                "take the base model from; give --model BASE"
            ) from None
        return
    if args.lineage and len(args.lineage) > 1:
        raise ConfigError(
            "serve: several --lineage share one server only as LoRA adapters: give --lora-rank R"
        )
    if args.lineage:
        from grpoflow.flows.processes.policy_server import served_model_dir

        try:
            served_model_dir(store_root(args), args.lineage[0], args.model)
        except ValueError:
            raise ConfigError(
                f"--lineage {args.lineage[0]}: no promotion recorded under {store_root(args)}; give --model"
            ) from None


def cmd_serve(args) -> int:
    from grpoflow.flows.processes.policy_server import policy_server

    lora = args.lora_rank is not None
    policy_server(
        model_dir=args.model,
        lineage=None if lora or not args.lineage else args.lineage[0],
        lineages=args.lineage if lora else None,
        lora_rank=args.lora_rank,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        root=store_root(args),
    )
    return 0


def cmd_retrain(args) -> int:
    import json

    from grpoflow.flows.lineage.retrain import grpo_retrain

    cfg = cli_config(args)
    out = grpo_retrain(
        lineage=args.lineage,
        extra_steps=args.steps,
        config=cfg,
        eval_prompts=args.eval_prompts,
        server_url=args.server,
        gate_metric=args.metric,
        gate_margin=args.margin,
        eval_greedy=args.greedy,
    )
    d = out["decision"]
    print(
        json.dumps(
            {
                "decision": d["decision"],
                "reason": d["reason"],
                "eval": out["eval"],
                "incumbent_eval": out["incumbent_eval"],
            },
            default=str,
        )
    )
    return 0


def _server_inference(args):
    from grpoflow.tasks.config.inference import InferenceConfig

    return InferenceConfig(api_key=args.api_key) if args.api_key else InferenceConfig()


def cmd_promote(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.lineage.promote import base_version, checkpoint_version, promote, serving_version
    from grpoflow.storage.ids import validate_run_id
    from grpoflow.storage.promotions import PromotionError
    from grpoflow.tasks.push.push import WeightPushError

    root, run = store_root(args), validate_run_id(args.run)
    lineage = validate_run_id(args.lineage or run)
    try:
        candidate = checkpoint_version(root, run, args.step)
        incumbent = serving_version(root, lineage) or base_version(root, run)
        row = promote(
            root,
            lineage,
            candidate,
            incumbent=incumbent,
            server_url=args.server,
            inference=_server_inference(args),
            reason=args.reason,
        )
    except (PromotionError, WeightPushError) as e:
        raise ConfigError(str(e)) from None
    print(
        f"{lineage}: promoted {run} step {row['serving_step']}"
        + (f" into {args.server}" if args.server else "")
    )
    return 0


def cmd_rollback(args) -> int:
    from grpoflow.flows.config import ConfigError
    from grpoflow.flows.lineage.promote import rollback
    from grpoflow.storage.ids import validate_run_id
    from grpoflow.storage.promotions import PromotionError
    from grpoflow.tasks.push.push import WeightPushError

    try:
        row = rollback(
            store_root(args),
            validate_run_id(args.lineage),
            server_url=args.server,
            inference=_server_inference(args),
        )
    except (PromotionError, WeightPushError) as e:
        raise ConfigError(str(e)) from None
    print(f"{args.lineage}: {row['reason']}" + (f" on {args.server}" if args.server else ""))
    return 0


def cmd_evaluate(args) -> int:
    import json

    from grpoflow.flows.lineage.evaluate import grpo_evaluate
    from grpoflow.storage.ids import validate_run_id

    cfg = cli_config(args)
    if args.run:
        validate_run_id(args.run)  # before the flow run: a bad id is one line, not a failed flow run
    result = grpo_evaluate(
        config=cfg,
        run_id=args.run,
        checkpoint=args.checkpoint,
        prompts=args.prompts,
        greedy=args.greedy,
        server_url=args.server,
    )
    print(json.dumps(result))
    return 0


def cmd_report(args) -> int:
    from grpoflow.flows.viewing.report import grpo_report_flow
    from grpoflow.storage.ids import validate_run_id

    validate_run_id(args.run)  # before the flow run: a bad id is one line, not a failed flow run

    print(grpo_report_flow()(run_id=args.run, root=store_root(args), out_dir=args.out))
    return 0


def _config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: configs/tiny-letters.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")


def _live_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help="live policy server to load the version into (default: record only)")
    p.add_argument(
        "--api-key", default=api_key_from_env(), help="bearer key of --server (default: $GRPOFLOW_API_KEY)"
    )
    p.add_argument("--root", help=ROOT_HELP)
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def add_flow_commands(sub) -> None:
    """The commands that run a Prefect flow: train, serve, evaluate, retrain, promote, rollback, report."""
    for add in (
        _train_parser,
        _serve_parser,
        _evaluate_parser,
        _retrain_parser,
        _promote_parser,
        _rollback_parser,
        _report_parser,
    ):
        add(sub)


def _train_parser(sub) -> None:
    t = sub.add_parser("train", help="run grpo-train (no arguments: the tiny demo)")
    _config_options(t)
    t.add_argument("--resume", metavar="RUN", help="continue RUN from its latest checkpoint")
    t.add_argument("--run-id", help="name of a new run (default: generated)")
    t.add_argument("--root", help=ROOT_HELP)
    t.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    t.set_defaults(fn=cmd_train)


def _serve_parser(sub) -> None:
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
    v.add_argument("--api-key", default=api_key_from_env(), help=key_help)
    v.add_argument("--root", help="store root; the server's pid file goes to <root>/pids/")
    v.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    v.set_defaults(fn=cmd_serve, runs_flows=True, precheck=check_serve)


def _evaluate_parser(sub) -> None:
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


def _retrain_parser(sub) -> None:
    rt = sub.add_parser(
        "retrain", help="run grpo-retrain: train a lineage N more steps, promote it only if better"
    )
    _config_options(rt)
    rt.add_argument("--lineage", required=True, help="the lineage (a run id) to continue")
    rt.add_argument("--steps", type=int, default=10, help="steps to train (default: 10)")
    rt.add_argument("--server", help="live policy server the promoted weights go into")
    rt.add_argument(
        "--metric",
        default="reward_mean",
        choices=get_args(GateMetric),
        help="gate metric (default: reward_mean)",
    )
    rt.add_argument("--margin", type=float, default=0.0, help="the candidate must beat the incumbent by more")
    rt.add_argument("--eval-prompts", type=int, help="at most this many eval rows (default: the eval split)")
    rt.add_argument("--greedy", action="store_true", help="evaluate one greedy completion per row")
    rt.add_argument("--root", help=ROOT_HELP)
    rt.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    rt.set_defaults(fn=cmd_retrain, runs_flows=True)


def _promote_parser(sub) -> None:
    pr = sub.add_parser("promote", help="serve a run's checkpoint: load it into --server and record it")
    pr.add_argument("run", help="run id")
    pr.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    pr.add_argument("--lineage", help="lineage recorded (default: the run id)")
    pr.add_argument("--reason", default="manual promotion", help="recorded with the decision")
    _live_server_options(pr)
    pr.set_defaults(fn=cmd_promote, runs_flows=True)


def _rollback_parser(sub) -> None:
    rb = sub.add_parser("rollback", help="serve a lineage's previous promoted version again")
    rb.add_argument("lineage", help="lineage (run id)")
    _live_server_options(rb)
    rb.set_defaults(fn=cmd_rollback, runs_flows=True)


def _report_parser(sub) -> None:
    rp = sub.add_parser("report", help="PNG plots + markdown summary of a run (also a Prefect artifact)")
    rp.add_argument("run", help="run id (see `grpoflow runs`)")
    rp.add_argument("--root", help=ROOT_HELP)
    rp.add_argument("--out", help="output folder (default: <root>/reports/<run>)")
    rp.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    rp.set_defaults(fn=cmd_report, runs_flows=True)
