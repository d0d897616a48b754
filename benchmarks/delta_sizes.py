"""How much of a model's bf16 weights one real AdamW step changes, and what the delta and its checksum
cost (server/delta.py; issue 59's first figures, before any delta is pushed).

For each model: float32 master weights and AdamW (the learner's recipe), `--steps` steps of the causal-LM
loss on random token batches at each `--lr`; after each step, the bf16 cast of the weights is compared
with the previous step's, bit for bit. Per (model, lr): the share of bf16 elements that changed, the
delta's bytes against the full bf16 weights (indices included; a tensor with most elements changed goes
whole), and the seconds `make_delta`, `apply_delta` and a full `checksum` take. AdamW's first steps
move every weight by about `lr` whatever the gradient's scale, so random batches size the update as a
real step does.

    .venv/bin/python benchmarks/delta_sizes.py --smollm2 models/smollm2-135m --random 0.5b --lr 1e-6 1e-5

Prints one JSON line per (model, lr).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import runpy
import shutil
import statistics
import tempfile
import time

import torch

from grpoflow.server.delta import apply_delta, checksum, delta_bytes, make_delta

HERE = Path(__file__).resolve().parent


def _bf16(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def measure(name: str, model_dir: Path, lrs: list[float], steps: int, batch: int, seq: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    rows = []
    for lr in lrs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        vocab = model.config.vocab_size
        base = _bf16(model)
        full = sum(t.numel() * t.element_size() for t in base.values())
        changed, sizes, t_make, t_apply = [], [], [], []
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, seq))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            new = _bf16(model)
            moved = sum(int((new[n].view(torch.int16) != base[n].view(torch.int16)).sum()) for n in new)
            changed.append(moved / sum(t.numel() for t in new.values()))
            t0 = time.perf_counter()
            delta, _ = make_delta(base, new)
            t1 = time.perf_counter()
            apply_delta(base, delta)  # base becomes new, as a server's copy would
            t_apply.append(time.perf_counter() - t1)
            t_make.append(t1 - t0)
            sizes.append(delta_bytes(delta) / full)
        t0 = time.perf_counter()
        checksum(base)
        rows.append({
            "model": name, "lr": lr, "steps": steps, "bf16_mb": round(full / 2**20, 1),
            "changed_frac_median": round(statistics.median(changed), 4),
            "delta_over_full_median": round(statistics.median(sizes), 4),
            "delta_over_full_max": round(max(sizes), 4),
            "make_delta_s_median": round(statistics.median(t_make), 3),
            "apply_delta_s_median": round(statistics.median(t_apply), 3),
            "checksum_s": round(time.perf_counter() - t0, 3),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del model, opt
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", help="converted SmolLM2-135M model dir")
    ap.add_argument("--random", nargs="*", default=[], choices=["0.5b", "1.5b"], help="random-model shapes")
    ap.add_argument("--lr", nargs="+", type=float, default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps per (model, lr) (default 3)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    if args.smollm2:
        measure("SmolLM2-135M", Path(args.smollm2).resolve(), args.lr, args.steps, args.batch, args.seq)
    if args.random:
        bench = runpy.run_path(str(HERE / "learner.py"), run_name="learner_bench")
        for size in args.random:
            tmp = Path(tempfile.mkdtemp(prefix="grpoflow-delta-"))
            try:
                bench["save_random_model"](size, tmp)
                measure(f"random:{size}", tmp, args.lr, args.steps, args.batch, args.seq)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
