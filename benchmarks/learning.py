"""grpoflow vs TRL's GRPOTrainer: learning on the SmolLM2 demo task, by step and by wall seconds.

One leg (system x seed) per invocation, on configs/smollm2-demo.yaml; no --system combines them.

A leg trains one system on the config with `run.seed=N`, `run.steps=--steps` and writes
`DIR/leg-<system>-seed<N>.json`: the per-step mean reward, the cumulative wall seconds at the end of
each step (since the start of step 0: model load, server start and TRL's trainer set-up are left out,
as in benchmarks/vs_trl.py's `wall_seconds`), the total, the overrides, the date and the machine.
Systems: `trl` is TRL's GRPOTrainer (benchmarks/vs_trl.py's `run_trl`: HF `generate` in the training
process, the same prompts in the same order, G, max tokens, LR, DAPO loss, seed); `s0`, `s1` and `s2`
are grpoflow with `algorithm.max_staleness` 0, 1 and 2 against one embedded vLLM CPU server (`-bf16`:
each computing in bf16). The store
(`--store`, default a temp dir removed afterwards) holds grpoflow's run and the tiny model if the
config asks for one. grpoflow's checkpoint save (the demo config saves once, after its last step) is
left out of its step times: TRL saves nothing.

    .venv/bin/python benchmarks/learning.py --system trl|s0|s1|s2[-bf16] [--seed N] [--steps N] [--out DIR]
        [--smollm2 models/smollm2-135m] [--config configs/smollm2-demo.yaml] [--store DIR]
    .venv/bin/python benchmarks/learning.py --system s0 --from-run ROOT RUN_ID [--out DIR]
    .venv/bin/python benchmarks/learning.py [--out DIR]

`--from-run ROOT RUN_ID` imports a finished grpoflow run as a leg (e.g. a `make demo-smollm2` run:
ROOT is its --root, `runs` by default; RUN_ID is `smollm2-demo-s<N>-...`) from its `steps` rows; the
seed, steps and staleness come from the run's stored config and must agree with --system (and with
--seed / --steps when given); where the stored learning settings differ from --config's, the leg
lists the differences. With no --system the recorded legs in DIR are combined: per seed, the target
is TRL's final 5-step mean reward; per leg, printed as a plain table and as Markdown (also written to
DIR/learning.md): its final 5-step mean, total wall seconds, the wall seconds at which its trailing
5-step mean reward (steps i-4..i; fewer at the start) first reaches the target, and that time over
TRL's own time to reach it, computed the same way. DIR/learning.png plots reward against step and
against wall seconds (thin: per-step mean; bold: trailing 5-step mean; dashed: TRL's target).

`--smollm2 DIR` overrides `model.path` for every system (default: the config's own, which for the
demo is models/smollm2-135m). `--config` exists for smoke tests on configs/tiny-letters.yaml.
Default DIR: benchmarks/results/learning.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for `benchmarks.workloads`, `flows`, `storage`

DEFAULT_CONFIG = REPO / "configs" / "smollm2-demo.yaml"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "learning"
# system -> max_staleness; a `-bf16` system is its float32 one computing in bf16 (TRL: `bf16=True`, CPU
# autocast; grpoflow: `model.dtype=bfloat16`, whose servers then serve bf16 on a CPU that computes it)
SYSTEMS: dict[str, int | None] = {"trl": None, "s0": 0, "s1": 1, "s2": 2}
SYSTEMS |= {f"{s}-bf16": staleness for s, staleness in SYSTEMS.items()}
BASE_SYSTEMS = ("trl", "s0", "s2")  # the legs a seed needs (combine names the missing ones)
LABELS = {"trl": "TRL", "s0": "grpoflow s0", "s1": "grpoflow s1", "s2": "grpoflow s2"}
LABELS |= {f"{s}-bf16": f"{label} bf16" for s, label in LABELS.items()}
WINDOW = 5  # steps in the final and trailing means
# Config keys that do not change what is learned: where things are, which run it is.
IGNORED_KEYS = ("storage.", "run.run_id", "run.seed", "run.steps", "run.checkpoint_every", "inference.url")

# -- learning-curve arithmetic (pure) -------------------------------------------------------------


def _mean(xs: list[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def final_mean(rewards: list[float | None], window: int = WINDOW) -> float | None:
    """Mean reward of the last `window` steps (steps with no valid reward are left out)."""
    return _mean(rewards[-window:])


def trailing_means(rewards: list[float | None], window: int = WINDOW) -> list[float | None]:
    """Per step i, the mean reward of steps i-window+1..i (of steps 0..i while i < window-1)."""
    return [_mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]


def first_reach(
    rewards: list[float | None], walls: list[float], target: float | None, window: int = WINDOW
) -> tuple[int, float] | None:
    """(step, cumulative wall seconds at its end) of the first step whose trailing mean reward is at
    least `target`; None when it never is. A run reaches its own final mean at its last step at the
    latest (the same floats, the same arithmetic), so TRL always reaches its own target."""
    if target is None:
        return None
    for i, m in enumerate(trailing_means(rewards, window)):
        if m is not None and m >= target - 1e-12:
            return i, walls[i]
    return None


# -- legs -----------------------------------------------------------------------------------------


def leg_path(out: Path, system: str, seed: int) -> Path:
    return out / f"leg-{system}-seed{seed}.json"


def _rel(p: Path | str) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def write_leg(out: Path, leg: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = leg_path(out, leg["system"], leg["seed"])
    path.write_text(json.dumps(leg, indent=1) + "\n")
    print(
        f"# wrote {_rel(path)}: final {WINDOW}-step mean {_fmt(final_mean(leg['rewards']))}, "
        f"{leg['total_wall_seconds']:.0f} s",
        flush=True,
    )
    return path


def _leg(system: str, seed: int, config: Path, overrides: list[str], rewards, walls, **extra) -> dict:
    return {
        "system": system,
        "seed": seed,
        "steps": len(rewards),
        "config": _rel(config),
        "overrides": overrides,
        "rewards": [None if r is None else round(float(r), 4) for r in rewards],
        "wall_seconds": [round(float(w), 3) for w in walls],
        "total_wall_seconds": round(float(walls[-1]), 3) if walls else 0.0,
        **extra,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "node": platform.node(),
        "cpus": os.cpu_count(),
    }


def _grpoflow_leg(system: str, seed: int, config: Path, overrides: list[str], rows, **extra) -> dict:
    """A leg from a grpoflow run's `steps` rows: checkpoint saves are left out of the step times."""
    ckpt = [float(r.get("checkpoint_seconds") or 0.0) for r in rows]
    walls = [float(r["wall_seconds"]) - c for r, c in zip(rows, ckpt, strict=True)]
    rewards = [r.get("reward/mean") for r in rows]
    return _leg(system, seed, config, overrides, rewards, _cumulative(walls),
                checkpoint_seconds_excluded=round(sum(ckpt), 3), **extra)  # fmt: skip


def _model_path(cfg, smollm2: str | None) -> str:
    """`model.path` as a path that exists from here: --smollm2, else the config's own (a relative one
    tried under the repository too); `tiny` stays `tiny` (prepare_model builds it)."""
    path = smollm2 or cfg.model.path
    if path == "tiny":
        return path
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO / p).exists():
        p = REPO / p
    return str(p.resolve())


def _cumulative(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def run_leg(
    system: str, seed: int, steps: int | None, config: Path, smollm2: str | None, store: Path
) -> dict:
    """Train one leg in `store` and return it."""
    import grpoflow.flows  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)
    from grpoflow.flows.cli.shared import quiet_prefect_task_logs
    from grpoflow.flows.config import load_config
    from grpoflow.flows.processes.prefect_api import owned_prefect_api
    from grpoflow.flows.training.runs import new_run_id, prepare_model

    bf16 = system.endswith("-bf16")
    sets = [f"storage.root={store}", f"run.seed={seed}"] + (["model.dtype=bfloat16"] if bf16 else [])
    cfg = load_config(config, sets)
    steps = steps or cfg.run.steps
    sets.append(f"run.steps={steps}")
    # The tiny model is built here (seeded, once per store); both systems then load the same directory.
    model_dir = prepare_model(load_config(config, [*sets, f"model.path={_model_path(cfg, smollm2)}"]))
    sets.append(f"model.path={model_dir.resolve()}")
    base = load_config(config, sets)

    if SYSTEMS[system] is None:
        from benchmarks.vs_trl import run_trl

        r = run_trl(config, sets, steps=steps, out_dir=store / f"trl-seed{seed}", bf16=bf16)
        walls = r["step_end_seconds"]
        return _leg(system, seed, config, sets, r["reward_curve"], walls, run_seconds=r["run_seconds"])

    from benchmarks.workloads import run_steps, serve

    staleness = SYSTEMS[system]
    run_id = f"learning-{system}-seed{seed}-{new_run_id()[5:]}"
    quiet_prefect_task_logs()
    t0 = time.perf_counter()
    with owned_prefect_api(), serve(base, model_dir, store / "vllm.log", staleness) as server:
        print(f"# vLLM server up in {time.perf_counter() - t0:.0f}s", flush=True)
        rows, run_seconds = run_steps(
            config, sets, url=server.url, steps=steps, staleness=staleness, run_id=run_id
        )
    used = [
        *sets,
        f"algorithm.max_staleness={staleness}",
        f"run.run_id={run_id}",
        f"run.checkpoint_every={steps}",
        "inference.url=<embedded vLLM server>",
    ]
    return _grpoflow_leg(system, seed, config, used, rows, run_seconds=round(run_seconds, 3))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: d}


def config_differences(stored: dict, current: dict) -> list[str]:
    """`key: stored -> current` for every learning-relevant setting that differs."""
    a, b = _flat(stored), _flat(current)
    diffs = []
    for k in sorted(a.keys() | b.keys()):
        if k.startswith(IGNORED_KEYS) or k == "model.path":
            continue
        if a.get(k) != b.get(k):
            diffs.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return diffs


def import_run(
    system: str, root: Path, run_id: str, seed: int | None, steps: int | None, config: Path
) -> dict[str, Any]:
    """A finished grpoflow run's `steps` rows as the leg of `system`."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.runs import _import_path_of
    from grpoflow.storage.rollouts import RolloutStore
    from grpoflow.storage.sql import query

    if SYSTEMS[system] is None:
        raise SystemExit("--from-run imports grpoflow runs only (s0, s1 or s2)")
    meta = RolloutStore(root).read_run_meta(run_id)
    cols, rows = query(root, "SELECT * FROM steps WHERE run_id = $run ORDER BY step", {"run": run_id})
    rows = [dict(zip(cols, r, strict=True)) for r in rows]
    if not rows:
        raise SystemExit(f"no steps rows for run {run_id!r} under {root}")
    got = [int(r["step"]) for r in rows]
    if got != list(range(len(got))):
        raise SystemExit(f"run {run_id!r}: steps {got} are not 0..{len(got) - 1} once each")
    if steps is not None and steps != len(rows):
        raise SystemExit(f"run {run_id!r} has {len(rows)} steps, not --steps {steps}")
    notes: list[str] = []
    stored = (meta or {}).get("config")
    if stored:
        run_seed, run_steps = stored["run"]["seed"], stored["run"]["steps"]
        staleness = stored["algorithm"]["max_staleness"]
        if staleness != SYSTEMS[system]:
            raise SystemExit(
                f"run {run_id!r} has max_staleness {staleness}; {system} needs {SYSTEMS[system]}"
            )
        if len(rows) != run_steps:
            raise SystemExit(f"run {run_id!r} has {len(rows)} steps rows of its {run_steps} steps")
        if seed is not None and seed != run_seed:
            raise SystemExit(f"run {run_id!r} has run.seed {run_seed}, not --seed {seed}")
        seed = run_seed
        current = load_config(config, [f"run.seed={seed}", f"algorithm.max_staleness={staleness}"])
        diffs = config_differences(stored, current.model_dump(mode="json", fallback=_import_path_of))
        for d in diffs:
            print(f"# warning: the run's config differs from {_rel(config)}: {d}", flush=True)
    else:
        notes.append("the run stored no config: seed and staleness taken from the command line")
        print(f"# warning: {notes[-1]}", flush=True)
        diffs = []
        if seed is None:
            raise SystemExit(f"run {run_id!r} stored no config: pass --seed")
    if (meta or {}).get("status") != "completed":
        notes.append(f"the run's recorded status is {(meta or {}).get('status')!r}, not 'completed'")
        print(f"# warning: {notes[-1]}", flush=True)
    overrides = [f"run.seed={seed}", f"run.steps={len(rows)}", f"algorithm.max_staleness={SYSTEMS[system]}"]
    return _grpoflow_leg(
        system,
        seed,
        config,
        overrides,
        rows,
        from_run={
            "root": str(Path(root).resolve()),
            "run_id": run_id,
            "status": (meta or {}).get("status"),
            "created_at": (meta or {}).get("created_at"),
            "config_differences": diffs,
            "notes": notes,
        },
    )


# -- combine --------------------------------------------------------------------------------------


def load_legs(out: Path) -> list[dict[str, Any]]:
    legs = []
    for p in sorted(out.glob("leg-*-seed*.json")):
        try:
            leg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"# skipping {p.name}: {e}")
            continue
        if leg.get("system") not in SYSTEMS or not leg.get("rewards"):
            print(f"# skipping {p.name}: not a leg")
            continue
        legs.append(leg)
    order = list(SYSTEMS)
    return sorted(legs, key=lambda g: (g["seed"], order.index(g["system"])))


def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def summarize(legs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per leg: final mean, total wall seconds, first reach of its seed's TRL target (`trl_reference`)."""
    rows = []
    for g in legs:
        t = trl_reference(legs, g["seed"])
        target = final_mean(t["rewards"]) if t else None
        t_reach = first_reach(t["rewards"], t["wall_seconds"], target) if t else None
        reach = first_reach(g["rewards"], g["wall_seconds"], target)
        frac = reach[1] / t_reach[1] if reach and t_reach and t_reach[1] > 0 else None
        rows.append(
            {
                "system": g["system"],
                "seed": g["seed"],
                "steps": g["steps"],
                "final": final_mean(g["rewards"]),
                "total": g["total_wall_seconds"],
                "target": target,
                "reach": reach,
                "frac": frac,
            }
        )
    return rows


def trl_reference(legs: list[dict[str, Any]], seed: int) -> dict[str, Any] | None:
    """The seed's TRL leg every leg is timed against: of its TRL legs (float32, bf16), the one that
    reaches its own final level soonest (TRL at its best settings on this machine); None: no TRL leg."""
    trl = [g for g in legs if g["seed"] == seed and SYSTEMS[g["system"]] is None]

    def own_time(g: dict[str, Any]) -> float:
        reach = first_reach(g["rewards"], g["wall_seconds"], final_mean(g["rewards"]))
        return reach[1] if reach else float("inf")

    return min(trl, key=own_time, default=None)


def _reach_cell(r: dict[str, Any]) -> str:
    if r["target"] is None:
        return "no TRL leg"
    return "never" if r["reach"] is None else f"{r['reach'][1]:.0f} (step {r['reach'][0]})"


def print_tables(rows: list[dict[str, Any]]) -> str:
    """Print the plain table and the Markdown table; return the Markdown."""
    head = f"{'system':<12} {'seed':>4} {'steps':>5} {'target':>7} {'final5':>7} {'wall s':>8} "
    head += f"{'reach target at s':>18} {'x TRL time':>10}"
    print(head)
    for r in rows:
        print(
            f"{LABELS[r['system']]:<12} {r['seed']:>4} {r['steps']:>5} {_fmt(r['target']):>7} "
            f"{_fmt(r['final']):>7} {r['total']:>8.0f} {_reach_cell(r):>18} {_fmt(r['frac'], 2):>10}"
        )
    md = [
        f"| system | seed | steps | TRL target (last-{WINDOW} mean) | last-{WINDOW} mean reward | wall s "
        f"| trailing {WINDOW}-step mean reaches target at s | time to target / TRL's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {LABELS[r['system']]} | {r['seed']} | {r['steps']} | {_fmt(r['target'])} | "
            f"{_fmt(r['final'])} | {r['total']:.0f} | {_reach_cell(r)} | {_fmt(r['frac'], 2)} |"
        )
    text = "\n".join(md)
    print()
    print(text)
    return text


def plot(legs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"trl": "tab:blue", "s0": "tab:orange", "s1": "tab:brown", "s2": "tab:green"}
    colors |= {"trl-bf16": "tab:purple", "s0-bf16": "tab:red", "s1-bf16": "tab:pink", "s2-bf16": "tab:olive"}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({g["seed"] for g in legs})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for g in legs:
        c, ls = colors[g["system"]], styles[seeds.index(g["seed"]) % len(styles)]
        xs_step = list(range(len(g["rewards"])))
        trail = trailing_means(g["rewards"])
        label = f"{LABELS[g['system']]}, seed {g['seed']}"
        for ax, xs in ((axes[0], xs_step), (axes[1], g["wall_seconds"])):
            raw = [(x, r) for x, r in zip(xs, g["rewards"], strict=True) if r is not None]
            ax.plot([x for x, _ in raw], [r for _, r in raw], color=c, lw=0.8, alpha=0.35, ls=ls)
            ax.plot(xs, trail, color=c, lw=2, ls=ls, label=label)
    for seed in seeds:
        if (g := trl_reference(legs, seed)) is not None:
            target = final_mean(g["rewards"])
            for ax in axes:
                ax.axhline(target, color="black", ls=(0, (4, 3)), lw=1, alpha=0.7)
            axes[1].annotate(
                f"TRL target, seed {g['seed']}: {target:.3f}",
                (0.01, target),
                xycoords=("axes fraction", "data"),
                va="bottom",
                fontsize=8,
            )
    from matplotlib.ticker import MaxNLocator

    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall seconds since the start of step 0")
    axes[0].set_ylabel("mean reward (thin: per step; bold: trailing 5-step mean)")
    axes[0].set_title("reward vs step")
    axes[1].set_title("reward vs wall seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    cfgs = sorted({g["config"] for g in legs})
    fig.suptitle(f"grpoflow vs TRL GRPOTrainer: learning on {', '.join(cfgs)} (dashed: TRL's last-5 mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def combine(out: Path) -> int:
    legs = load_legs(out)
    if not legs:
        print(f"# no legs in {_rel(out)}: record them with --system trl|s0|s1|s2 [--seed N]")
        return 0
    for key in ("config", "steps"):
        vals = sorted({str(g[key]) for g in legs})
        if len(vals) > 1:
            print(f"# warning: the legs differ in {key}: {', '.join(vals)}")
    seeds = sorted({g["seed"] for g in legs})
    have = {(g["system"], g["seed"]) for g in legs}
    for seed in seeds:
        missing = [s for s in BASE_SYSTEMS if (s, seed) not in have]
        if missing:
            print(
                f"# seed {seed}: missing legs {', '.join(missing)} "
                f"(record: benchmarks/learning.py --system {missing[0]} --seed {seed})"
            )
            if "trl" in missing:
                print(f"# seed {seed}: no TRL leg, so no target for its other legs")
    print()
    rows = summarize(legs)
    md = print_tables(rows)
    (out / "learning.md").write_text(md + "\n")
    png = out / "learning.png"
    plot(legs, png)
    print(f"\n# wrote {_rel(out / 'learning.md')} and {_rel(png)}")
    return 0


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--system", choices=list(SYSTEMS), help="record this leg (none: combine the legs in --out)"
    )
    ap.add_argument("--seed", type=int, default=None, help="run.seed (default 0; --from-run: the run's)")
    ap.add_argument(
        "--steps", type=int, default=None, help="run.steps (default: the config's, 25 for the demo)"
    )
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"legs, table, figure (default {_rel(DEFAULT_OUT)})"
    )
    ap.add_argument("--smollm2", default=None, help="model.path for every system (default: the config's)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"default {_rel(DEFAULT_CONFIG)}")
    ap.add_argument(
        "--store", type=Path, default=None, help="grpoflow store root (default: a temp dir, removed)"
    )
    ap.add_argument("--from-run", nargs=2, metavar=("ROOT", "RUN_ID"), help="import a finished grpoflow run")
    args = ap.parse_args(argv)

    if args.system is None:
        if args.from_run:
            ap.error("--from-run needs --system s0 or s2")
        return combine(args.out)
    if args.from_run:
        root, run_id = args.from_run
        leg = import_run(args.system, Path(root), run_id, args.seed, args.steps, args.config)
        write_leg(args.out, leg)
        return 0
    seed = 0 if args.seed is None else args.seed
    store = args.store or Path(tempfile.mkdtemp(prefix="grpoflow-learning-"))
    store.mkdir(parents=True, exist_ok=True)
    try:
        leg = run_leg(args.system, seed, args.steps, args.config, args.smollm2, store.resolve())
    finally:
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    write_leg(args.out, leg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
