"""grpoflow against TRL's GRPOTrainer: the same task, model, prompts, group size, completion length,
learning rate, loss and number of steps, in one invocation.

Per workload the runs alternate TRL (`use_vllm=False`: HF `generate` in the training process, CPU),
grpoflow with `max_staleness` 0 and grpoflow with `max_staleness` 2; both grpoflow runs share one
vLLM CPU server (each pushes its own initial weights first, so they are independent). Printed per
system: wall seconds for the N steps, median seconds per step (steps 1..N-1; step 0 includes warm-up),
generation tokens/s, and the per-step reward curve, so equal learning is visible. `wall_seconds` sums
the N step times; `run_seconds` is the whole call (model load, TRL's trainer set-up, grpoflow's initial
weight push, and for the first grpoflow run the start of Prefect's ephemeral API). TRL's
`train_seconds` is its step minus its `generate` call (reward, forward/backward, optimizer).

Workloads: `tiny` (configs/tiny-letters.yaml: random tiny model, reward = fraction of "a") and
`smollm2` (SmolLM2-135M-Instruct, grpoflow.examples.envs:arith_rows + grpoflow.examples.rewards:exact_number, no tools,
32 new tokens, lr 5e-6; configs/smollm2-tools.yaml with its tools and warm-up off).

    .venv/bin/python benchmarks/vs_trl.py [--workloads tiny smollm2] [--smollm2 models/smollm2-135m]
        [--steps N] [--repeats R] [--lora RANK]

What is the same: prompts (grpoflow's seeded per-step order, replayed to TRL unshuffled), chat template,
G, max tokens, temperature 1, the reward functions on the same text (completion ids decoded without
special tokens, by TRL and grpoflow alike), group-scaled advantages, DAPO loss, beta 0, AdamW
(torch, no weight decay), grad clip 1.0, constant LR, one optimizer step per generated batch, the same
micro-batch size, float32, seed, and with `learner.lora` in the config the same peft LoRA adapter (rank,
alpha, dropout, target modules) on both sides. What differs by design: TRL samples with HF `generate` from the learner
itself (exactly on-policy); grpoflow samples on vLLM and applies its off-policy correction (tis).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import itertools
import json
import tempfile
import time
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for `benchmarks.workloads`

from benchmarks.workloads import WORKLOADS, med, prepare, rnd, run_steps, serve

# -- grpoflow -------------------------------------------------------------------------------------


def run_grpoflow(config: Path, overrides: list[str], *, url: str, steps: int, staleness: int, run_id: str):
    steps_rows, run_seconds = run_steps(
        config, overrides, url=url, steps=steps, staleness=staleness, run_id=run_id
    )
    later = steps_rows[1:] or steps_rows  # step 0 includes warm-up
    return {
        "system": f"grpoflow-s{staleness}",
        "steps": len(steps_rows),
        "wall_seconds": rnd(sum(float(s["wall_seconds"]) for s in steps_rows)),
        "run_seconds": rnd(run_seconds),
        "seconds_per_step": rnd(med([s["wall_seconds"] for s in later])),
        "gen_seconds": rnd(med([s["gen_seconds"] for s in later])),
        "train_seconds": rnd(med([s["train/seconds"] for s in later])),
        "sync_seconds": rnd(med([s["sync_seconds"] for s in later])),
        "gen_tokens_per_step": rnd(med([s["gen/tokens"] for s in later]), 1),
        "gen_tokens_per_s": rnd(med([s["gen/tokens_per_s"] for s in later]), 1),
        "reward_curve": [rnd(s.get("reward/mean"), 4) for s in steps_rows],
    }


# -- TRL ------------------------------------------------------------------------------------------


def trl_reward(spec, tokenizer):
    """A grpoflow reward function in TRL's signature, scoring the same text grpoflow scores: the
    completion ids decoded without special tokens (TRL's `completions` are message dicts here)."""
    from grpoflow.flows.config import resolve_import

    fn = resolve_import(spec.fn, "rewards")

    def reward(prompts, completions, completion_ids, **columns):
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        keep = {k: v for k, v in columns.items() if k not in ("trainer_state", "log_extra", "log_metric")}
        return fn(completions=texts, prompts=prompts, completion_ids=completion_ids, **keep, **spec.kwargs)

    reward.__name__ = spec.name
    return reward


def trl_dataset(cfg, steps: int):
    """grpoflow's prompts for steps 0..N-1, in its order, as conversational rows (TRL: no shuffle)."""
    from datasets import Dataset

    from grpoflow.flows.training.data import load_rows, rows_for_step

    rows = load_rows(cfg)
    d = cfg.data
    out: list[dict[str, Any]] = []
    for step in range(steps):
        batch, _ = rows_for_step(rows, step, d.prompts_per_step, seed=cfg.run.seed, shuffle=d.shuffle)
        for row in batch:
            item = {k: v for k, v in row.items() if k != "prompt"}
            p = row["prompt"]
            item["prompt"] = [{"role": "user", "content": p}] if isinstance(p, str) else p
            out.append(item)
    return Dataset.from_list(out)


def trl_lora(lora):
    """The config's `learner.lora` as the peft LoraConfig TRL's trainer takes (None: full fine-tuning)."""
    if lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")  # fmt: skip


def run_trl(config: Path, overrides: list[str], *, steps: int, out_dir: Path, bf16: bool = False):
    from grpoflow.flows.config import load_config

    cfg = load_config(config, overrides)
    g, a, lc = cfg.generation, cfg.algorithm, cfg.learner
    if g.max_turns != 1 or cfg.tools.tools or cfg.tools.environment:
        raise SystemExit("vs_trl compares single-turn, tool-free workloads only")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    total = cfg.data.prompts_per_step * g.group_size
    mbs = min(lc.micro_batch_size, total)
    if total % mbs:
        raise SystemExit(f"micro_batch_size {mbs} must divide prompts_per_step x group_size = {total}")
    accum = total // mbs
    schedule = {"constant": "constant_with_warmup" if lc.warmup_steps else "constant"}.get(
        lc.lr_schedule, lc.lr_schedule
    )
    args = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        report_to="none",
        bf16=bf16,  # CPU autocast over float32 weights (benchmarks/learning.py's trl-bf16 leg)
        fp16=False,
        gradient_checkpointing=lc.gradient_checkpointing,
        # One optimizer step per generated batch of prompts_per_step x G completions, in micro-batches
        # of grpoflow's micro_batch_size (gradient accumulation), each completion used once.
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,
        num_iterations=1,
        num_generations=g.group_size,
        max_completion_length=g.max_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        learning_rate=lc.lr,
        lr_scheduler_type=schedule,
        warmup_steps=lc.warmup_steps,
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.max_grad_norm,
        optim="adamw_torch",
        beta=a.beta,
        epsilon=a.epsilon,
        epsilon_high=a.epsilon_high,
        loss_type=a.loss_type,
        scale_rewards=a.scale,
        reward_weights=[r.weight for r in cfg.rewards],
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        seed=cfg.run.seed,
        data_seed=cfg.run.seed,
        shuffle_dataset=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    model_dir = str(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    gen_log: list[tuple[float, int]] = []  # (seconds, tokens) per generation call

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **kw)
            gen_log.append((time.perf_counter() - t0, sum(len(c) for c in completion_ids)))
            return completion_ids, logprobs

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin = 0.0
            self.ends: list[float] = []
            self.rewards: dict[int, float] = {}

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards[state.global_step] = logs["reward"]

    clock = Clock()
    t0 = time.perf_counter()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(r, tokenizer) for r in cfg.rewards],
        args=args,
        train_dataset=trl_dataset(cfg, steps),
        processing_class=tokenizer,
        callbacks=[clock],
        peft_config=trl_lora(lc.lora),
    )
    trainer.remove_callback(PrinterCallback)  # its per-step log dicts; our JSON line says it all
    trainer.train()
    run_seconds = time.perf_counter() - t0

    edges = [clock.begin, *clock.ends]
    walls = [b - a for a, b in itertools.pairwise(edges)]
    later = slice(1, None) if len(walls) > 1 else slice(None)
    gen_s = [s for s, _ in gen_log]
    gen_tok = [n for _, n in gen_log]
    rates = [n / s for s, n in gen_log if s > 0]
    result = {
        "system": "trl",
        "steps": len(walls),
        "wall_seconds": rnd(sum(walls)),
        "run_seconds": rnd(run_seconds),
        "seconds_per_step": rnd(med(walls[later])),
        "gen_seconds": rnd(med(gen_s[later])),
        # TRL's train step = the rest of its step (scoring, logprob forward/backward, optimizer).
        "train_seconds": rnd(med([w - s for w, s in zip(walls[later], gen_s[later], strict=False)])),
        "sync_seconds": 0.0,
        "gen_tokens_per_step": rnd(med(gen_tok[later]), 1),
        "gen_tokens_per_s": rnd(med(rates[later]), 1),
        "reward_curve": [rnd(clock.rewards.get(i + 1), 4) for i in range(len(walls))],
        # End of each step, seconds since the start of step 0 (benchmarks/learning.py's time axis).
        "step_end_seconds": [rnd(e - clock.begin) for e in clock.ends],
    }
    del trainer, model
    return result


# -- main -----------------------------------------------------------------------------------------


def print_table(results: list[dict[str, Any]]) -> None:
    head = f"{'workload':<9} {'system':<12} {'steps':>5} {'wall s':>8} {'s/step':>7} {'x TRL':>6} "
    head += f"{'gen s':>6} {'train s':>7} {'gen tok/s':>9}  reward curve"
    print(head)
    base: dict[str, float] = {}
    for r in results:
        if r["system"] == "trl" and r["seconds_per_step"]:
            base.setdefault(r["workload"], r["seconds_per_step"])
    for r in results:
        b = base.get(r["workload"])
        speed = f"{b / r['seconds_per_step']:.2f}" if b and r["seconds_per_step"] else "-"
        curve = " ".join("-" if v is None else f"{v:.2f}" for v in r["reward_curve"])
        print(
            f"{r['workload']:<9} {r['system']:<12} {r['steps']:>5} {r['wall_seconds']:>8.2f} "
            f"{r['seconds_per_step']:>7.3f} {speed:>6} {r['gen_seconds'] or 0:>6.3f} "
            f"{r['train_seconds'] or 0:>7.3f} {r['gen_tokens_per_s'] or 0:>9.1f}  {curve}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["tiny", "smollm2"])
    ap.add_argument("--smollm2", default=str(REPO / "models" / "smollm2-135m"), help="SmolLM2 model dir")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: tiny 10, smollm2 8)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of TRL, grpoflow s0, grpoflow s2")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    ap.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="grpoflow-only config overrides"
    )
    ap.add_argument("--lora", type=int, metavar="RANK",
                    help="both systems train a rank-RANK LoRA adapter (alpha 2 x RANK, peft) at the same LR")  # fmt: skip
    args = ap.parse_args()

    import grpoflow.flows  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)
    from grpoflow.flows.config import load_config

    root = Path(tempfile.mkdtemp(prefix="grpoflow-vs-trl-"))
    results: list[dict[str, Any]] = []
    for name in args.workloads:
        prepared = prepare(name, root, args.smollm2)
        if prepared is None:
            continue
        wroot, model, overrides = prepared
        if args.lora:
            overrides = [*overrides, f"learner.lora={{rank: {args.lora}, alpha: {2 * args.lora}}}"]
        spec = WORKLOADS[name]
        steps = args.steps or spec["steps"]
        base = load_config(spec["config"], overrides)
        t_server = time.perf_counter()
        with serve(base, model, wroot / "vllm.log") as server:
            print(f"# {name}: vLLM server up in {time.perf_counter() - t_server:.0f}s", flush=True)
            for rep in range(args.repeats):
                runs = [("trl", None)] + [("grpoflow", k) for k in args.staleness]
                for system, k in runs:
                    if system == "trl":
                        r = run_trl(spec["config"], overrides, steps=steps, out_dir=wroot / f"trl-{rep}")
                    else:
                        r = run_grpoflow(
                            spec["config"],
                            [*overrides, *args.set],
                            url=server.url,
                            steps=steps,
                            staleness=k,
                            run_id=f"vs-trl-s{k}-r{rep}",
                        )
                    r = {"workload": name, "repeat": rep, **r}
                    results.append(r)
                    print(json.dumps(r), flush=True)
    print()
    print_table(results)


if __name__ == "__main__":
    main()
