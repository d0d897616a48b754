"""Weight push seconds, full model against a LoRA adapter, on the real vLLM CPU server.

For each model: one server started as a LoRA run's embedded server is (`--enable-lora`, max rank 16),
then `--repeats` full pushes (`checkpoint` backend: safetensors save + pause / reload_weights / resume)
and `--repeats` adapter pushes (`lora` backend: a rank-`--rank` PEFT adapter on the attention and MLP
projections, saved + /v1/load_lora_adapter), then `--repeats` merged-adapter pushes (`lora_merged`: the
same adapter saved, then pause / the server merges it into its weights / resume), each through
`tasks.push.push_version` as a run pushes.
Prints one JSON line per model with the medians.

Models: SmolLM2-135M (`--smollm2 DIR`, converted by `make models/smollm2-135m`) and random models of
benchmarks/learner.py's shapes (`--random 0.5b 1.5b`: Qwen2.5-0.5B's and 1.5B's, bf16 on disk, served in
float32 as the CPU build serves every model; the server skips tokenizer start-up, nothing is generated).

    .venv/bin/python benchmarks/lora_push.py --smollm2 models/smollm2-135m --random 0.5b 1.5b
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

from grpoflow.flows.processes.serve import start_server
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.push.push import push_version, weight_push
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet

HERE = Path(__file__).resolve().parent


def pushes(url: str, root: Path, backend: str, write, repeats: int) -> dict:
    pusher = weight_push(root, f"bench-{backend}", SyncConfig(backend=backend), InferenceConfig())
    replicas = ReplicaSet([Replica(0, url)])
    stats = [push_version(pusher, write, v + 1, replicas) for v in range(repeats)]
    return {
        "push_seconds_median": round(statistics.median(s.total_seconds for s in stats), 4),
        "save_seconds_median": round(statistics.median(s.save_seconds for s in stats), 4),
        "load_seconds_median": round(statistics.median(s.reload_seconds for s in stats), 4),
    }


def measure(label: str, model_dir: Path, root: Path, rank: int, repeats: int, extra: tuple[str, ...]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.learner.lora import attach, write_adapter
    from grpoflow.tasks.push.weights import save_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    row: dict = {"model": label, "params": params, "rank": rank}
    with start_server(model_dir, max_model_len=512, kv_cache_gb=1, log_path=root / f"{label}.log",
                      lora_rank=LoraConfig(rank=rank).served_rank(), extra_args=extra) as server:  # fmt: skip
        row["full"] = pushes(server.url, root, "checkpoint", lambda d: save_weights(model, d), repeats)
        shutil.rmtree(root / "weights", ignore_errors=True)
        peft_model = attach(model, LoraConfig(rank=rank, alpha=2 * rank))
        with torch.no_grad():  # a non-identity adapter, as a trained one is
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.01)
        row["adapter_params"] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        row["adapter"] = pushes(server.url, root, "lora", lambda d: write_adapter(peft_model, d), repeats)
        row["merged"] = pushes(
            server.url, root, "lora_merged", lambda d: write_adapter(peft_model, d), repeats
        )
    for kind in ("adapter", "merged"):
        row[f"{kind}_over_full"] = round(
            row[kind]["push_seconds_median"] / row["full"]["push_seconds_median"], 4
        )
    shutil.rmtree(root / "weights", ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", help="converted SmolLM2-135M model dir")
    ap.add_argument("--random", nargs="*", default=[], choices=["0.5b", "1.5b"], help="random-model shapes")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="pushes of each kind (median)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="grpoflow-lora-push-"))
    try:
        if args.smollm2:
            print(json.dumps(measure("SmolLM2-135M", Path(args.smollm2), root, args.rank, args.repeats, ())),
                  flush=True)  # fmt: skip
        learner_bench = runpy.run_path(str(HERE / "learner.py"), run_name="learner_bench")
        for size in args.random:
            model_dir = root / f"random-{size}"
            learner_bench["save_random_model"](size, model_dir)
            print(json.dumps(measure(f"random:{size}", model_dir, root, args.rank, args.repeats,
                                     ("--skip-tokenizer-init",))), flush=True)  # fmt: skip
            shutil.rmtree(model_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
