"""How close the pipeline gets to its limits: raw generation and raw training, measured in the same run.

Per workload, with one vLLM CPU server:
1. raw generation: the vLLM server alone, through tasks.inference.VLLMClient, for the batch shape of a
   step (prompts_per_step requests of n = group_size completions of max_tokens, all in flight at once,
   the real prompts, temperature 1, seeded), no training. EOS may end completions early, as in the
   pipeline (no ignore_eos): tokens are counted, not assumed. Measured with one batch in flight and
   with max_staleness + 1 batches in flight (as the pipeline keeps them); the faster rate is the bound.
2. raw train: tasks.learn.Learner.train_step alone (built like grpo-train builds it) on samples of the
   same shape, made from the completions of one batch of (1) (the timed batch with the median token
   count: its prompt and completion ids, vLLM logprobs, advantages +-1 so every sample trains: the most
   train work a step can hold), no generation; also the raw weight push (save + pause/reload/resume).
3. the pipeline: grpo-train for N steps with max_staleness k against the same server; its s/step is the
   mean over the steady steps k+1..N-1 of the `steps` table (step 0 waits for the first k + 1 batches,
   which steps 1..k then find ready); the median over steps 1..N-1 and the whole run's mean are printed
   too.

Each measure also prints where the cores went while it ran (`CpuMeter`, from psutil): core-seconds of
the whole machine, of the vLLM server's processes, and of this process (the learner, the flow, the
rollout client), per batch or per step, and the machine's busy share of all its cores. A step that
keeps every core busy cannot get shorter by overlapping more: only by doing less work.

ratio = pipeline s/step / max(raw gen s, raw train s); target <= 1.25. Also printed: the ratio against
max(gen, train + push), since the pipeline pushes weights on the learner's critical path every step, and
the ratio to gen + train + push: on a CPU-only machine both sides compete for the same cores, so the sum,
not the max, is what full overlap can reach there.

    .venv/bin/python benchmarks/limits.py [--workloads tiny smollm2] [--smollm2 models/smollm2-135m]
        [--steps N] [--repeats R]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import gc
import json
import os
import tempfile
import threading
import time
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for `benchmarks.workloads`

from benchmarks.workloads import WORKLOADS, med, prepare, rnd, run_steps, serve
from grpoflow.storage.processes import cpu_seconds

TARGET = 1.25


# -- where the cores go ---------------------------------------------------------------------------


class CpuMeter:
    """Core-seconds spent while a measure runs: the machine's (every process), the vLLM server's process
    tree and this process's own threads, sampled on a thread every `period` seconds so that a window
    of a run (its steady steps) can be cut out afterwards."""

    def __init__(self, server_pid: int, period: float = 0.2):
        self.server_pid, self.period = server_pid, period
        self.samples: list[tuple[float, float, float, float]] = []  # (time, machine, server, self)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def sample(self) -> tuple[float, float, float, float]:
        t = psutil.cpu_times()
        machine = t.user + t.nice + t.system + t.irq + t.softirq + t.steal  # all but idle and iowait
        server = cpu_seconds(self.server_pid, tree=True)
        return time.time(), machine, server, cpu_seconds(os.getpid())

    def mark(self) -> float:
        """Sample now (a window's edge); returns the sample's time."""
        self.samples.append(self.sample())
        return self.samples[-1][0]

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(self.sample())

    def __enter__(self) -> CpuMeter:
        self.samples.append(self.sample())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    def window(self, t0: float | None = None, t1: float | None = None, per: int = 1) -> dict[str, float]:
        """Core-seconds from the sample nearest `t0` to the one nearest `t1` (default: all), divided by
        `per` (batches or steps), and the machine's busy share of its cores over that window."""
        near = lambda t: min(self.samples, key=lambda s: abs(s[0] - t))  # noqa: E731
        a = self.samples[0] if t0 is None else near(t0)
        b = self.samples[-1] if t1 is None else near(t1)
        wall = max(b[0] - a[0], 1e-9)
        return {
            "machine_core_s": rnd((b[1] - a[1]) / per),
            "server_core_s": rnd((b[2] - a[2]) / per),
            "trainer_core_s": rnd((b[3] - a[3]) / per),
            "other_core_s": rnd(((b[1] - a[1]) - (b[2] - a[2]) - (b[3] - a[3])) / per),
            "cores_busy": rnd((b[1] - a[1]) / wall / (os.cpu_count() or 1)),
        }


# -- 1. raw generation ----------------------------------------------------------------------------


def step_prompts(cfg, tokenizer, rows, step: int) -> list[list[int]]:
    """Token ids of step `step`'s prompts, rendered exactly as tasks/rollouts/generate.py renders them."""
    from grpoflow.flows.training.data import rows_for_step
    from grpoflow.tasks.rollouts.templates import prompt_messages, render

    d = cfg.data
    batch, cursor = rows_for_step(rows, step, d.prompts_per_step, seed=cfg.run.seed, shuffle=d.shuffle)
    return [
        tokenizer.encode(render(tokenizer, prompt_messages(row, i), None, True), add_special_tokens=False)
        for row, i in zip(batch, cursor, strict=True)
    ]


async def raw_generation(cfg, url: str, batches: list[list[list[int]]], in_flight: int = 1) -> dict[str, Any]:
    """Step-shaped batches, `in_flight` of them at once (all their requests together), the first round a
    warm-up; seconds per batch = round seconds / in_flight. With max_staleness k the pipeline keeps up
    to k + 1 batches in flight, and the server's throughput grows with its batch."""
    from grpoflow.tasks.rollouts.inference import VLLMClient

    g = cfg.generation
    seconds, tokens, outputs = [], [], []
    async with VLLMClient(url, max_in_flight=g.max_in_flight * in_flight) as client:
        max_len = await client.max_model_len()
        for r in range(0, len(batches) - in_flight + 1, in_flight):
            t0 = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    client.complete(
                        ids,
                        max_tokens=min(g.max_tokens, max_len - len(ids)),
                        temperature=g.temperature,
                        top_p=g.top_p,
                        n=g.group_size,
                        seed=cfg.run.seed * 1_000_003 + b * 10_007 + i,
                    )
                    for b in range(r, r + in_flight)
                    for i, ids in enumerate(batches[b])
                )
            )
            seconds.append((time.perf_counter() - t0) / in_flight)
            tokens.append(sum(len(ch.token_ids) for choices in outs for ch in choices) / in_flight)
            prompts = [ids for b in range(r, r + in_flight) for ids in batches[b]]
            outputs.append(list(zip(prompts, outs, strict=True))[: len(batches[r])])
    timed = slice(1, None) if len(seconds) > 1 else slice(None)
    s, n = med(seconds[timed]), med(tokens[timed])
    return {
        "measure": "raw_generation",
        "batches_in_flight": in_flight,
        "rounds": len(seconds[timed]),
        "completions_per_batch": len(batches[0]) * g.group_size,
        "max_tokens": g.max_tokens,
        "ignore_eos": False,
        "seconds": rnd(s),
        "tokens_per_batch": rnd(n, 1),
        "tokens_per_s": rnd(n / s if s else None, 1),
        # The train measure uses the timed round whose token count is closest to the median.
        "_outputs": outputs[min(range(1, len(outputs)) or [0], key=lambda b: abs(tokens[b] - n))],
    }


# -- 2. raw train (and raw push) ------------------------------------------------------------------


def samples_like_a_step(outputs) -> list:
    """TrainSamples of one step's shape from generated completions (advantages +-1: every sample trains)."""
    from grpoflow.tasks.learner.learner_api import TrainSample

    out = []
    for prompt_ids, choices in outputs:
        for j, ch in enumerate(choices):
            if not ch.token_ids:
                continue
            out.append(
                TrainSample(
                    input_ids=list(prompt_ids) + list(ch.token_ids),
                    prompt_len=len(prompt_ids),
                    completion_mask=[1] * len(ch.token_ids),
                    behaviour_logprobs=list(ch.logprobs),
                    advantage=1.0 if j % 2 == 0 else -1.0,
                )
            )
    return out


def raw_train(
    cfg, model_dir: Path, samples, repeats: int, url: str, root: Path, meter: CpuMeter
) -> list[dict[str, Any]]:
    from grpoflow.flows.training.runs import RunState, build_learner
    from grpoflow.tasks.push.push import push_version, weight_push
    from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet

    run = RunState("limits-raw", 0, 0, str(model_dir), str(model_dir), None, False)
    learner = build_learner(cfg, run)
    learner.train_step(samples)  # warm-up
    t = meter.mark()
    seconds = [learner.train_step(samples)["train/seconds"] for _ in range(repeats)]
    train_cpu = meter.window(t, meter.mark(), per=repeats)
    t = meter.mark()
    sync = cfg.sync.model_copy(update={"keep_last": 1})
    pusher = weight_push(str(root), "limits-raw", sync, cfg.inference)
    servers = ReplicaSet([Replica(0, url)])
    pushes = [
        push_version(pusher, learner.write_weights, v + 1, servers).total_seconds for v in range(repeats + 1)
    ]
    push_cpu = meter.window(t, meter.mark(), per=repeats + 1)
    tokens = sum(sum(s.completion_mask) for s in samples)
    train_s, push_s = med(seconds), med(pushes[1:])
    del learner
    gc.collect()
    return [
        {
            "measure": "raw_train",
            "steps": repeats,
            "samples": len(samples),
            "completion_tokens": tokens,
            "micro_batch_size": cfg.learner.micro_batch_size,
            "seconds": rnd(train_s),
            "tokens_per_s": rnd(tokens / train_s if train_s else None, 1),
            "cpu_per_step": train_cpu,
        },
        {"measure": "raw_push", "pushes": repeats, "seconds": rnd(push_s), "cpu_per_push": push_cpu},
    ]


# -- 3. the pipeline ------------------------------------------------------------------------------


def pipeline(
    config: Path, overrides: list[str], *, url: str, steps: int, staleness: int, meter: CpuMeter
) -> dict[str, Any]:
    every, _ = run_steps(
        config, overrides, url=url, steps=steps, staleness=staleness, run_id=f"limits-s{staleness}"
    )
    later = every[1:]  # step 0 includes warm-up
    # Steady state: step 0 also waits for the first k + 1 batches, generated together, so steps 1..k
    # find theirs ready; from step k + 1 on every batch is generated beside training.
    steady = every[staleness + 1 :] or later
    # The steady steps' cores: from the end of the step before them (its row's time) to the last row.
    first = every[staleness] if len(every) > staleness + 1 else every[0]
    cpu = meter.window(first["created_at"].timestamp(), every[-1]["created_at"].timestamp(), per=len(steady))
    return {
        "measure": "pipeline",
        "max_staleness": staleness,
        "steps": steps,
        "seconds_per_step": rnd(sum(s["wall_seconds"] for s in steady) / len(steady)),
        "median_seconds_per_step": rnd(med(s["wall_seconds"] for s in later)),
        "run_seconds_per_step": rnd(sum(s["wall_seconds"] for s in every) / len(every)),
        "gen_seconds": rnd(med(s["gen_seconds"] for s in later)),
        "score_seconds": rnd(med(s["score_seconds"] for s in later)),
        "train_seconds": rnd(med(s["train/seconds"] for s in later)),
        "sync_seconds": rnd(med(s["sync_seconds"] for s in later)),
        "learner_wait_seconds": rnd(med(s["wait_seconds"] for s in later)),
        "gen_tokens_per_step": rnd(med(s["gen/tokens"] for s in later), 1),
        "gen_tokens_per_s": rnd(med(s["gen/tokens_per_s"] for s in later), 1),
        "cpu_per_step": cpu,
    }


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["tiny", "smollm2"])
    ap.add_argument("--smollm2", default=str(REPO / "models" / "smollm2-135m"), help="SmolLM2 model dir")
    ap.add_argument("--steps", type=int, default=None, help="pipeline steps (default: tiny 10, smollm2 8)")
    ap.add_argument("--repeats", type=int, default=5, help="timed raw batches / train steps (+1 warm-up)")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides")
    args = ap.parse_args()

    import grpoflow.flows  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.data import load_rows
    from grpoflow.tasks.rollouts.templates import load_tokenizer

    root = Path(tempfile.mkdtemp(prefix="grpoflow-limits-"))
    table, cores = [], []
    for name in args.workloads:
        prepared = prepare(name, root, args.smollm2)
        if prepared is None:
            continue
        wroot, model, overrides = prepared
        spec = WORKLOADS[name]
        steps = args.steps or spec["steps"]
        overrides = [*overrides, *args.set]
        cfg = load_config(spec["config"], overrides)
        tokenizer, rows = load_tokenizer(str(model)), load_rows(cfg)
        k = args.staleness + 1
        batches = [step_prompts(cfg, tokenizer, rows, s) for s in range((args.repeats + 1) * k)]
        with serve(cfg, model, wroot / "vllm.log") as server, CpuMeter(server.proc.pid) as meter:
            t = meter.mark()
            gen1 = asyncio.run(raw_generation(cfg, server.url, batches[: args.repeats + 1]))
            gen1["cpu_per_batch"] = meter.window(t, meter.mark(), per=args.repeats + 1)
            outputs = gen1.pop("_outputs")
            gen = gen1
            if k > 1:  # the server's rate at the pipeline's concurrency; the bound takes the faster
                t = meter.mark()
                genk = asyncio.run(raw_generation(cfg, server.url, batches, in_flight=k))
                genk["cpu_per_batch"] = meter.window(t, meter.mark(), per=len(batches))
                genk.pop("_outputs")
                print(json.dumps({"workload": name, **gen1}), flush=True)
                gen = min(gen1, genk, key=lambda g: g["seconds"])
            train, push = raw_train(
                cfg, model, samples_like_a_step(outputs), args.repeats, server.url, wroot, meter
            )
            pipe = pipeline(
                spec["config"], overrides, url=server.url, steps=steps, staleness=args.staleness, meter=meter
            )
        bound = max(gen["seconds"], train["seconds"])
        bound_push = max(gen["seconds"], train["seconds"] + push["seconds"])
        limit = {
            "measure": "limit",
            "seconds_per_step": pipe["seconds_per_step"],
            "raw_gen_seconds": gen["seconds"],
            "raw_gen_batches_in_flight": gen["batches_in_flight"],
            "raw_train_seconds": train["seconds"],
            "raw_push_seconds": push["seconds"],
            "ratio": rnd(pipe["seconds_per_step"] / bound),
            "ratio_with_push": rnd(pipe["seconds_per_step"] / bound_push),
            # Generation and training share the CPU cores: their sum is the bound without spare cores.
            "ratio_to_sum": rnd(
                pipe["seconds_per_step"] / (gen["seconds"] + train["seconds"] + push["seconds"])
            ),
            "target": TARGET,
            "met": pipe["seconds_per_step"] / bound <= TARGET,
        }
        for r in (gen, train, push, pipe, limit):
            print(json.dumps({"workload": name, **r}), flush=True)
        table.append((name, gen, train, push, pipe, limit))
        cores.append((name, [("raw gen, 1 batch in flight", gen1["cpu_per_batch"])]
                      + ([(f"raw gen, {k} in flight", genk["cpu_per_batch"])] if k > 1 else [])
                      + [("raw train step", train["cpu_per_step"]), ("raw push", push["cpu_per_push"]),
                         ("pipeline step (steady)", pipe["cpu_per_step"])]))  # fmt: skip

    print()
    print(
        f"{'workload':<9} {'raw gen s':>9} {'gen tok':>8} {'raw train s':>11} {'raw push s':>10} "
        f"{'pipe s/step':>11} {'pipe tok':>8} {'ratio':>6} {'w/ push':>7} {'to sum':>6}  target <= {TARGET}"
    )
    for name, gen, train, push, pipe, limit in table:
        print(
            f"{name:<9} {gen['seconds']:>9.3f} {gen['tokens_per_batch']:>8.0f} {train['seconds']:>11.3f} "
            f"{push['seconds']:>10.3f} {pipe['seconds_per_step']:>11.3f} {pipe['gen_tokens_per_step']:>8.0f} "
            f"{limit['ratio']:>6.2f} {limit['ratio_with_push']:>7.2f} {limit['ratio_to_sum']:>6.2f}  "
            f"{'met' if limit['met'] else 'NOT met'}"
        )
    print()
    print(f"where the cores went: core-seconds per batch / step / push; busy = the machine's share of its "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(
        f"{'workload':<9} {'measure':<28} {'machine':>8} {'server':>8} {'trainer':>8} {'other':>8} {'busy':>6}"
    )
    for name, rows in cores:
        for what, c in rows:
            print(
                f"{name:<9} {what:<28} {c['machine_core_s']:>8.3f} {c['server_core_s']:>8.3f} "
                f"{c['trainer_core_s']:>8.3f} {c['other_core_s']:>8.3f} {c['cores_busy']:>6.2f}"
            )


if __name__ == "__main__":
    main()
