"""The `grpoflow` commands that treat stored rollouts as data (dataset, rescore, replay): each command's
function and its parser (flows/lineage/dataset.py, rescore.py, replay.py)."""

from __future__ import annotations

from grpoflow.flows.cli.shared import ROOT_HELP, VERBOSE_HELP, quiet_prefect_task_logs, sql_text, store_root


def cmd_dataset(args) -> int:
    from grpoflow.flows.lineage.dataset import export_dataset

    card = export_dataset(store_root(args), sql_text(args.sql), args.format, args.out)
    runs = ", ".join(card["runs"]) if card["runs"] is not None else "runs not selected"
    print(f"{card['rows']} rows ({runs}) as {card['format']} -> {args.out}")
    return 0


def cmd_rescore(args) -> int:
    from grpoflow.flows.lineage.rescore import rescore_run, reward_specs

    done = rescore_run(store_root(args), args.run, reward_specs(args.reward), args.name)
    counts = "; ".join(
        f"{n}: " + ", ".join(f"{k} {v}" for k, v in sorted(by.items())) for n, by in done["statuses"].items()
    )
    print(
        f"{done['run']}: rescore {done['rescore']!r} version {done['version']}, {done['cells']} cells ({counts})"
    )
    print(f"what it judged otherwise: grpoflow sql --canned rescore_disagreements --run {done['run']}")
    return 0


def cmd_replay(args) -> int:
    from grpoflow.flows.config import load_config
    from grpoflow.flows.lineage.replay import grpo_replay, plan

    config = load_config(args.config) if args.config else None
    where = sql_text(args.where) if args.where else None
    root = str(store_root(args))
    plan(args.run, config, args.set or [], where, args.run_id, args.resume, root)  # bad input: one line, now
    quiet_prefect_task_logs(not args.verbose)
    summary = grpo_replay(
        run=args.run,
        config=config,
        sets=args.set or [],
        where=where,
        replay_id=args.run_id,
        resume=args.resume,
        root=root,
    )
    print(
        f"replay {summary['run_id']} of {args.run}: {summary['steps_trained']} steps, reward "
        f"{summary['first_reward']} -> {summary['last_reward']}; grpoflow compare {args.run} {summary['run_id']}"
    )
    return 0


def add_data_commands(sub) -> None:
    """The commands that treat stored rollouts as data: dataset, rescore, replay."""
    for add in (_dataset_parser, _rescore_parser, _replay_parser):
        add(sub)


def _dataset_parser(sub) -> None:
    from grpoflow.flows.lineage.dataset import FORMATS as DATASET_FORMATS

    d = sub.add_parser(
        "dataset", help="what a SQL query selects, as a dataset (TRL's SFT or prompt format, ...)"
    )
    d.add_argument("out", help="output directory (new, or empty): the data and a README.md card")
    d.add_argument("--sql", required=True, help="a read-only query, or @file.sql to read it from a file")
    d.add_argument(
        "--format",
        required=True,
        choices=list(DATASET_FORMATS),
        help="trl-sft: prompt-completion "
        "rows; trl-prompt: prompt-only rows; jsonl/parquet: the rows as selected",
    )
    d.add_argument("--root", help=ROOT_HELP)
    d.set_defaults(fn=cmd_dataset)


def _rescore_parser(sub) -> None:
    r = sub.add_parser(
        "rescore", help="score a run's stored completions with other rewards (its own cells stay)"
    )
    r.add_argument("run", help="run id")
    r.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME=module:fn",
        help="a reward function, as NAME=module:function (repeat for more)",
    )
    r.add_argument(
        "--name", default="rescore", help="the rescore's name in the rescores table (default: rescore)"
    )
    r.add_argument("--root", help=ROOT_HELP)
    r.set_defaults(fn=cmd_rescore)


def _replay_parser(sub) -> None:
    r = sub.add_parser("replay", help="train again on a run's stored groups, no generation (grpo-replay)")
    r.add_argument("run", help="the run whose groups are replayed")
    r.add_argument(
        "--config", help="the replay's YAML config (default: the run's own); what made the samples must match"
    )
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of it (repeatable)")
    r.add_argument(
        "--where", help="SQL predicate over rollouts: the groups with a matching completion (or @file.sql)"
    )
    r.add_argument("--run-id", help="the replay's run id (default: RUN-replay)")
    r.add_argument("--resume", metavar="REPLAY", help="continue an interrupted replay")
    r.add_argument("--root", help=ROOT_HELP)
    r.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    r.set_defaults(fn=cmd_replay, runs_flows=True)
