"""The learner on a CUDA GPU in one short window: its tests, its step figures, a push's weight write.

Made for a GPU machine lent for minutes (torch, transformers, peft, pyarrow and pytest there; no
vLLM, Prefect or network): `make gpu-wheels` gathers what else the tests import (pydantic) into
`.whl/`, and the one command to run there is

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
        PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_learner.py --out $OUT

It must finish, imports included, well inside 8 minutes on an H100. Parts, in order; every figure is
printed (one JSON line) and `gpu_learner.json` / `gpu_learner.md` under --out are rewritten the moment
it is measured, so a run cut off still reports what it had:

1. tests: pytest on the learner's, the loss's and the precision recipe's unit tests with
   `--learner-device cuda` (the same tests the CPU suite runs); log in `tests.log`.
2. steps: a train step of 8 prompts x 8 completions, prompt 256 + completion 512 tokens, on random
   weights of real shapes (benchmarks/learner.py's MODEL_SHAPES: SmolLM2-135M, Qwen2.5-0.5B,
   Qwen2.5-1.5B) in the learner's recipe (bf16 compute over float32 master weights): full fine-tuning
   and LoRA rank 16, each with gradient checkpointing off and on; for the largest shape, full
   fine-tuning at larger micro-batches too. Time (median of --repeats after a warm-up step), tokens/s,
   MFU (benchmarks/learner.py's model-FLOP count over the GPU's bf16 peak), peak memory.
3. push: the weight write of a full push at the largest shape (float32 master weights on the GPU
   written as bf16 safetensors, as `Learner.write_weights` does), a new file and an overwrite.
4. profile (--profile): the torch profiler over one full step at the largest shape; the top operators
   by GPU time in `profile.txt`, and the share of matmuls, attention, the LM head's softmax, the
   optimizer and the rest.

`--dry-run`: the same code on the CPU with the tiny shape and a few tokens (tests/unit runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# This folder's scripts (storage.py, inference.py, ...) must not shadow modules of those names. On a bare
# machine, benchmarks/learner.py (loaded before any grpoflow import) maps `grpoflow` onto the checkout.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

TESTS = ["tests/unit/test_learn.py", "tests/unit/test_lora_learner.py", "tests/unit/test_grpo.py",
         "tests/unit/test_precision.py", "tests/unit/test_lm_head_chunk.py"]  # fmt: skip


def load_learner_bench():
    spec = importlib.util.spec_from_file_location("learner_bench", HERE / "learner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Report:
    """Every figure as it comes: printed, and the JSON and markdown under `out` rewritten."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.data = out, {"meta": meta, "tests": None, "steps": [], "push": [], "profile": None}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, value) -> None:
        if isinstance(self.data[part], list):
            self.data[part].append(value)
        else:
            self.data[part] = value
        print(json.dumps({part: value}), flush=True)
        (self.out / "gpu_learner.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "gpu_learner.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = [f"Device: {m.get('device_name')}, torch {m['torch']}, transformers {m['transformers']}, "
             f"peft {m.get('peft')}, {m['date']}. Step: {m['step']}.", ""]  # fmt: skip
    if data["tests"]:
        lines += [f"Tests (`--learner-device {m['learner_device']}`): {data['tests']['summary']}", ""]
    lines += ["| shape | mode | grad ckpt | shared prompt | micro-batch | step s | tokens/s | TFLOP/s | MFU | peak GiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in data["steps"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['mode']} | {r['gradient_checkpointing']} | "
                         f"{r.get('share_prompt')} | {r['micro_batch_size']} | {r['error'][:80]} | | | | |")  # fmt: skip
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(
            f"| {r['shape']} | {r['mode']} | {'on' if r['gradient_checkpointing'] else 'off'} | "
            f"{'on' if r['share_prompt'] else 'off'} | {r['micro_batch_size']} | {r['seconds_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['achieved_tflops']:.1f} | {mfu} | {r['peak_memory_mib'] / 1024:.1f} |"
        )
    for p in data["push"]:
        if "error" in p:
            lines += ["", f"Push write ({p['shape']}): {p['error']}"]
            continue
        lines += ["", f"Push write ({p['shape']}, {p['dtype']}, {p['file_gib']:.2f} GiB): "
                      f"{p['kind']} {p['seconds']:.2f} s ({p['gib_per_s']:.2f} GiB/s)"]  # fmt: skip
    if data["profile"] and "error" in data["profile"]:
        lines += ["", f"Profile: {data['profile']['error']}"]
    elif data["profile"]:
        pr = data["profile"]
        shares = ", ".join(f"{k} {v:.0%}" for k, v in pr["shares"].items())
        lines += ["", f"Profile of one step ({pr['shape']}, shared prompt {pr['share_prompt']}): "
                      f"{pr['total_ms']:.0f} ms of GPU time in a {pr['step_wall_ms']:.0f} ms step "
                      f"({pr['busy_fraction']:.0%} busy); of the GPU time: {shares}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def run_tests(device: str, out: Path, tests: list[str], timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio", "-o", "addopts=",
           "--learner-device", device, *tests]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\nTIMED OUT after {timeout_s} s", -1
    (out / "tests.log").write_text(log)
    tail = [ln for ln in log.splitlines() if ln.strip()]
    failed = [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))]
    return {"returncode": rc, "summary": tail[-1] if tail else "", "failed": failed[:20],
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def variants(shapes: list[str], largest_micro_batches: list[int]) -> list[dict]:
    out = []
    for shape in shapes:
        for lora in (None, 16):
            for gc in (False, True):
                out.append(
                    {"shape": shape, "lora": lora, "gradient_checkpointing": gc, "micro_batch_size": 8}
                )
        if shape == shapes[-1]:
            out += [{"shape": shape, "lora": None, "gradient_checkpointing": False, "micro_batch_size": n}
                    for n in largest_micro_batches]  # fmt: skip
            if largest_micro_batches:  # learner.lm_head_chunk: the logits never whole, at the largest
                out.append(out[-1] | {"lm_head_chunk": 4096})
                # the bf16 copy of the master weights made per micro-batch, as before one_cast_per_update
                out.append({"shape": shape, "lora": None, "gradient_checkpointing": False, "micro_batch_size": 8,
                            "cast_each": True})  # fmt: skip
    return out


def parse_variant(spec: str) -> dict:
    """SHAPE:MODE:GC:MB[:SHARE][:compile][:chunkN][:casteach], e.g. 1.5b:full:on:32, 1.5b:lora16:off:8:on
    (share_prompt on; left out: the learner's default, off on a GPU), 1.5b:full:off:8:compile
    (`learner.compile`: each decoder layer torch.compiled), 1.5b:full:off:32:chunk4096
    (`learner.lm_head_chunk` 4096: the LM head over 4096 positions at a time) or 1.5b:full:off:8:casteach
    (the bf16 copy of the master weights made per micro-batch: tasks/learner/speed.py off)."""
    shape, mode, gc, mb, *rest = spec.split(":")
    share = [r for r in rest if r in ("on", "off")]
    chunk = [int(r.removeprefix("chunk")) for r in rest if r.startswith("chunk")]
    return {"shape": shape, "lora": int(mode.removeprefix("lora")) if mode != "full" else None,
            "gradient_checkpointing": gc == "on", "micro_batch_size": int(mb),
            "share_prompt": {"on": True, "off": False}[share[0]] if share else None,
            "compile": "compile" in rest, "lm_head_chunk": chunk[0] if chunk else None,
            "cast_each": "casteach" in rest}  # fmt: skip


def step_row(bench, model_dir: str, samples, v: dict, device: str, repeats: int) -> dict:
    import types

    args = types.SimpleNamespace(device=device, repeats=repeats, lora=v["lora"])
    spec = {"share_prompt": v.get("share_prompt"), "skip_zero_advantage": True, "micro_batch_size": v["micro_batch_size"],
            "num_iterations": 1, "mini_batches": 1, "dtype": "auto",
            "gradient_checkpointing": v["gradient_checkpointing"], "compile": v.get("compile", False),
            "lm_head_chunk": v.get("lm_head_chunk")}  # fmt: skip
    if not v.get("cast_each"):
        return bench.run_variant(model_dir, f"random:{v['shape']}", samples, spec, args)
    import contextlib

    import grpoflow.tasks.learner.learn as learn

    one = learn.one_cast_per_update
    learn.one_cast_per_update = lambda *a: contextlib.nullcontext()
    try:
        return bench.run_variant(model_dir, f"random:{v['shape']}", samples, spec, args)
    finally:
        learn.one_cast_per_update = one


def default_learner(bench, model_dir: str, device: str):
    """A full fine-tuning Learner with the learner's defaults (micro-batch 8, shared prompt auto)."""
    from grpoflow.tasks.learner.learn import Learner
    from grpoflow.tasks.learner.learner_api import LearnerRun

    cfg, alg, source = bench.make_configs(micro_batch_size=8, share_prompt=None, device=device)
    return Learner(model_dir, cfg, alg, LearnerRun(total_steps=10), model=bench.model_config("auto", source))


def push_rows(bench, model_dir: str, shape: str, device: str, directory: Path) -> list[dict]:
    """Learner.write_weights of a full learner, twice: into a new file, then over it in place."""
    import torch

    learner = default_learner(bench, model_dir, device)
    rows = []
    directory.mkdir(parents=True, exist_ok=True)
    for kind in ("new file", "overwrite"):
        if learner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        learner.write_weights(directory)
        seconds = time.perf_counter() - t0
        size = (directory / "model.safetensors").stat().st_size
        rows.append({"shape": shape, "kind": kind, "dtype": str(learner.dtype).removeprefix("torch."),
                     "file_gib": size / 2**30, "seconds": round(seconds, 3),
                     "gib_per_s": round(size / 2**30 / seconds, 2)})  # fmt: skip
    del learner
    return rows


def profile_step(bench, model_dir: str, samples, shape: str, device: str, out: Path) -> dict:
    """One full step under the torch profiler: the top operators by device time, and shares."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    learner = default_learner(bench, model_dir, device)
    learner.train_step(samples)  # warm-up
    cuda = learner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        learner.train_step(samples)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    # The operators' own device time: each kernel counted once, under the operator that launched it
    # (the kernels' own rows, device-side events, are left out of the sums: they would count it twice).
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    (out / "profile.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    buckets = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
               "attention": ("scaled_dot_product", "flash", "efficient_attention", "cudnn_attention"),
               "logsumexp/softmax": ("logsumexp", "softmax"),
               "optimizer": ("adam", "_foreach"),
               "casts/copies": ("copy", "_to_copy", "cat", "index")}  # fmt: skip
    time_of = {e.key: getattr(e, key) for e in events if getattr(e, key) > 0}
    total = sum(time_of.values()) or 1
    shares = dict.fromkeys([*buckets, "other"], 0.0)
    for name, t in time_of.items():
        low = name.lower()
        b = next((b for b, words in buckets.items() if any(w in low for w in words)), "other")
        shares[b] += t / total
    top = sorted(time_of.items(), key=lambda kv: -kv[1])[:12]
    share_prompt = learner.share_prompt
    del learner
    # How much of the profiled step the GPU computes at all; the rest it waits on the host (launches,
    # Python). The profiler's own overhead makes the step longer than an unprofiled one.
    return {"shape": shape, "share_prompt": share_prompt, "time_kind": key, "total_ms": round(total / 1000, 1),
            "step_wall_ms": round(wall * 1000, 1), "busy_fraction": round(total / 1e6 / wall, 3),
            "shares": {k: round(v, 3) for k, v in shares.items()},
            "top": [[name, round(t / 1000, 2)] for name, t in top]}  # fmt: skip


def meta(device: str, step: str) -> dict:
    import torch
    import transformers

    info = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "learner_device": device, "step": step,
            "cuda": torch.version.cuda}  # fmt: skip
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:
        info["peft"] = None
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        info["device_name"] = platform.processor() or "cpu"
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-learner-out"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny shape, a few tokens")
    ap.add_argument("--shapes", nargs="+", help="default 135m 0.5b 1.5b; also 3b 7b (dry run: tiny)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per variant (+1 warm-up)")
    ap.add_argument("--micro-batch", type=int, nargs="*", default=[16, 32],
                    help="further micro-batch sizes for the largest shape's full fine-tuning")  # fmt: skip
    ap.add_argument(
        "--tests", nargs="*", help="test files (default: the learner's, the loss's, the recipe's)"
    )
    ap.add_argument("--variants", nargs="+", type=parse_variant, metavar="SHAPE:MODE:GC:MB[:SHARE]",
                    help="these step variants instead of the default grid, e.g. 1.5b:full:on:32")  # fmt: skip
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new part after this many seconds")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    bench = load_learner_bench()
    if args.dry_run:
        device, shapes, prompt, completion, prompts, group = "cpu", args.shapes or ["tiny"], 8, 8, 2, 2
        args.micro_batch, args.repeats = [], 1
        tests = args.tests if args.tests is not None else ["tests/unit/test_precision.py"]
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: use --dry-run on a CPU machine")
        device, shapes, prompt, completion, prompts, group = (
            "cuda",
            args.shapes or ["135m", "0.5b", "1.5b"],
            256,
            512,
            8,
            8,
        )
        tests = args.tests if args.tests is not None else TESTS
    step = f"{prompts} prompts x {group} completions, prompt {prompt} + completion {completion} tokens"
    report = Report(args.out, meta(device, step))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    if tests:
        report.add("tests", run_tests(device, args.out, tests, timeout_s=min(180.0, max(30.0, left() / 3))))

    with tempfile.TemporaryDirectory(prefix="gpu-learner-") as tmp:
        dirs: dict[str, str] = {}
        todo = args.variants or variants(shapes, args.micro_batch)
        shapes = list(dict.fromkeys(v["shape"] for v in todo))
        for v in todo:
            if left() < 0:
                report.add("steps", v | {"mode": "skipped", "error": "time budget spent"})
                continue
            shape = v["shape"]
            mode = (f"lora{v['lora']}" if v["lora"] else "full") + ("+compile" if v.get("compile") else "")
            mode += f"+chunk{v['lm_head_chunk']}" if v.get("lm_head_chunk") else ""
            mode += "+casteach" if v.get("cast_each") else ""
            vocab = bench.MODEL_SHAPES[shape][1]
            samples = bench.random_samples(vocab, prompts, group, (prompt, prompt), (completion, completion))
            try:
                if shape not in dirs:
                    dirs[shape] = str(Path(tmp) / shape)
                    bench.save_random_model(shape, Path(dirs[shape]), device=device)
                row = step_row(bench, dirs[shape], samples, v, device, args.repeats)
                report.add("steps", {"shape": shape, "mode": mode} | row)
            except Exception as e:
                traceback.print_exc()
                report.add("steps", v | {"mode": mode, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                if device == "cuda":
                    torch.cuda.empty_cache()
        largest = shapes[-1]
        if largest in dirs and not args.no_push and left() > 0:
            try:
                for row in push_rows(bench, dirs[largest], largest, device, Path(tmp) / "push"):
                    report.add("push", row)
            except Exception as e:
                traceback.print_exc()
                report.add("push", {"shape": largest, "error": f"{type(e).__name__}: {e}"})
        if largest in dirs and not args.no_profile and left() > 0:
            samples = bench.random_samples(bench.MODEL_SHAPES[largest][1], prompts, group, (prompt, prompt),
                                           (completion, completion))  # fmt: skip
            try:
                report.add("profile", profile_step(bench, dirs[largest], samples, largest, device, args.out))
            except Exception as e:
                traceback.print_exc()
                report.add("profile", {"shape": largest, "error": f"{type(e).__name__}: {e}"})
    print(markdown(report.data), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    failed_tests = report.data["tests"] and report.data["tests"]["returncode"] != 0
    return 1 if failed_tests or any("error" in r for r in report.data["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
