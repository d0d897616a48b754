"""Weight push over the network against by path, into one real vLLM CPU server on another host.

For each model: two hosts' worth of separation on this machine (tests/hosts.py: the server in a
network namespace on a bridge, in a mount namespace where the "far" store is an empty tmpfs), one vLLM
server (LoRA on, max rank 16, uploads on, an API key: it binds beyond loopback) and two learner
stores: the "near" one the server can read (`sync.transport` auto picks `path`), the "far" one it
cannot (auto picks `network`: the version's files go over HTTP into the server's own disk). The same
server takes both, so the two transports differ only in how the version reaches it. Per model:

- `--warmup` + `--repeats` full pushes (`checkpoint`: safetensors save + [upload] + pause /
  reload_weights / resume) by path, then over the network; medians of the last `--repeats` (the
  steady state: from a run's third push on, each overwrites the files of the version retention
  drops next, on both ends);
- the same for rank-`--rank` adapter pushes (`lora`: a new dir per version);
- a cut-off upload: a process sending a version is SIGKILLed after its second chunk (the
  `upload_chunk` failpoint), then the next network push, which must go through;
- what compression would save: zlib level 1 on the version's weights file, its ratio and MB/s,
  against the upload's MB/s;
- the HTTP floor: the seconds to carry the same weights file to a sink on the server's host through
  the same HTTP stack as vLLM's API server (uvicorn, httptools, uvloop) and the same client (aiohttp,
  8 MiB chunks, three at once), with no disk write or check.

With `--delta-lr LR...` it measures instead, per learning rate, bf16 pushes into a server that serves
bf16, each version one real AdamW step (float32 masters) at that rate after the one before: by path,
over the network whole (`sync.delta: off`) and as deltas (`sync.delta: on`, tasks/push/delta_push.py):
seconds, bytes, and how many pushes went as deltas. The versions are trained before the server starts
(a 1.5B learner's AdamW state and a server do not fit in 24 GB together) and pushed from their files.

Prints one JSON line per model with the medians. Root only (namespaces), like the hosts tests.

    .venv/bin/python benchmarks/network_push.py --smollm2 models/smollm2-135m --random 0.5b 1.5b
    .venv/bin/python benchmarks/network_push.py --smollm2 models/smollm2-135m --random 0.5b 1.5b --delta-lr 1e-6 1e-5
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.hosts

import argparse
import asyncio
import json
import math
import os
import runpy
import shutil
import statistics
import subprocess
import tempfile
import time
import zlib

from grpoflow.flows.processes.vllm_command import server_command
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.push.push import push_version, weight_push
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from tests.hosts import Hosts

HERE = Path(__file__).resolve().parent
KEY, PORT = "bench-network-push", 8000


def pushes(
    url: str, root: Path, run: str, backend: str, write, repeats: int, warmup: int, delta="off", step=None
) -> dict:
    """`warmup` pushes, then `repeats` timed ones (medians): a run's pushes from its third on (with
    keep_last 2) overwrite the files of the version retention drops next, on both ends, while its
    first ones fill new files, whose cost depends on how much free memory the machine has. `step()`
    runs before each push, untimed (a training step); `delta`: `sync.delta`."""
    pusher = weight_push(root, run, SyncConfig(backend=backend, delta=delta), InferenceConfig(api_key=KEY))
    replicas = ReplicaSet([Replica(0, url)])

    def one(v: int):
        if step is not None:
            step()
        return push_version(pusher, write, v, replicas)

    first = [one(v + 1) for v in range(warmup)]
    stats = [one(warmup + v + 1) for v in range(repeats)]
    (transport,) = set(pusher.transport.chosen().values())
    return {
        "delta_pushes": sum(s.delta_servers for s in stats),
        "upload_bytes_median": statistics.median(s.upload_bytes for s in stats),
        "transport": transport,
        "first_push_seconds": [round(s.total_seconds, 4) for s in first],
        "push_seconds": [round(s.total_seconds, 4) for s in stats],
        "push_seconds_median": round(statistics.median(s.total_seconds for s in stats), 4),
        "save_seconds_median": round(statistics.median(s.save_seconds for s in stats), 4),
        "upload_seconds_median": round(statistics.median(s.upload_seconds for s in stats), 4),
        "load_seconds_median": round(statistics.median(s.reload_seconds for s in stats), 4),
        "upload_bytes": stats[-1].upload_bytes,
    }


async def forget_all(url: str, prefix: str) -> None:
    async with VLLMClient(url, api_key=KEY) as c:
        for name in await c.uploaded_versions():
            if name.startswith(prefix):
                await c.delete_uploaded_version(name)


# The same HTTP stack as vLLM's API server (uvicorn, httptools, uvloop), answering every PUT once its
# body is read and dropped: what the bytes cost to carry before any disk write or check.
SINK = """
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})
uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), loop="uvloop", http="httptools", log_level="warning")
"""


def http_floor(host, python: str, path: Path, repeats: int) -> dict:
    """Seconds to carry `path`'s bytes to a sink on the server's host as the upload does (8 MiB
    chunks, three at once, aiohttp), median of `repeats`: the part of a network push no change to
    grpoflow's upload code can remove."""
    import aiohttp

    from grpoflow.tasks.push.upload import CHUNK_BYTES, STREAMS

    proc = host.run([python, "-c", SINK, host.address, str(PORT + 1)], stdout=subprocess.DEVNULL)
    try:
        host.wait_port(PORT + 1, timeout_s=60, proc=proc)
        data = memoryview(path.read_bytes())
        url = f"http://{host.address}:{PORT + 1}/sink"

        async def carry() -> float:
            async with aiohttp.ClientSession() as session:
                left = iter(range(0, len(data), CHUNK_BYTES))

                async def stream() -> None:
                    for at in left:
                        async with session.put(url, data=data[at : at + CHUNK_BYTES]) as r:
                            await r.read()

                t0 = time.perf_counter()
                await asyncio.gather(*(stream() for _ in range(STREAMS)))
                return time.perf_counter() - t0

        seconds = [asyncio.run(carry()) for _ in range(repeats)]
    finally:
        proc.kill()
        proc.wait()
    return {"http_floor_seconds": round(statistics.median(seconds), 4), "http_floor_bytes": len(data)}


def compression(version_dir: Path) -> dict:
    """zlib level 1 on the first 256 MiB of the version's largest file: what compressing the upload
    would save, and cost (a sample: a whole 1.5B file and its copy would not fit in memory here)."""
    biggest = max(version_dir.iterdir(), key=lambda p: p.stat().st_size)
    with open(biggest, "rb") as f:
        data = f.read(256 << 20)
    t0 = time.perf_counter()
    packed = zlib.compress(data, 1)
    seconds = time.perf_counter() - t0
    return {
        "zlib1_ratio": round(len(packed) / len(data), 4),
        "zlib1_mb_per_s": round(len(data) / seconds / 1e6, 1),
    }


def cut_off_then_push(url: str, far: Path, write) -> dict:
    """SIGKILL an uploading process after its second chunk, then push over the network again."""
    pusher = weight_push(far, "bench-cut", SyncConfig(), InferenceConfig(api_key=KEY))
    path = pusher.save(write, 1)
    code = (
        "import asyncio, sys\nfrom grpoflow.tasks.push.upload import upload_dir\n"
        f"asyncio.run(upload_dir({url!r}, {path!r}, 'bench-cut/v000001', api_key={KEY!r}, chunk_bytes=1 << 20))"
    )
    env = {**os.environ, "GRPOFLOW_FAULTS": "upload_chunk@2:kill"}
    killed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=600
    ).returncode
    stats = push_version(pusher, write, 2, ReplicaSet([Replica(0, url)]))

    async def versions() -> list[str]:
        async with VLLMClient(url, api_key=KEY) as c:
            return await c.uploaded_versions()

    return {"cut_exit": killed, "next_push_seconds": round(stats.total_seconds, 4),
            "next_push_recovered": "bench-cut/v000002" in asyncio.run(versions())}  # fmt: skip


def trained_versions(
    model_dir: Path, lr: float, count: int, out: Path, batch: int = 2, seq: int = 64
) -> list[Path]:
    """`count` versions of the model in `model_dir`, each one real AdamW step (float32 masters, the
    causal-LM loss on random tokens) after the one before, as bf16 safetensors files under `out`: at an
    RL learning rate a step moves every weight by about `lr`, as a training step does
    (benchmarks/delta_sizes.py). One AdamW per parameter, stepped as soon as its gradient is complete
    (torch's optimizer-in-backward pattern): the update of one AdamW over the model without holding every
    gradient at once, so that a 1.5B model's masters and AdamW state (18 GB) fit this machine's memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.push.weights import save_weights

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()

    def stepper(opt):
        def hook(_param) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hook

    hooks = [
        p.register_post_accumulate_grad_hook(stepper(torch.optim.AdamW([p], lr=lr, weight_decay=0.0)))
        for p in model.parameters()
    ]
    paths = []
    for k in range(count):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq))
        model(input_ids=ids, labels=ids).loss.backward()
        paths.append(out / f"lr{lr:g}-step{k + 1}")
        paths[-1].mkdir(parents=True)
        save_weights(model, paths[-1], dtype=torch.bfloat16)
    for h in hooks:  # a hook, held by the tensor's C++ side, holds its optimizer, which holds the tensor
        h.remove()
    return paths


def replay(dirs: list[Path]):
    """(step, write) for `pushes`: `step` reads the next of `dirs`' bf16 tensors, `write` writes them."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from grpoflow.tasks.push.weights import write_model_dir

    config, left, held = AutoConfig.from_pretrained(dirs[0]), iter(dirs), {}

    def step() -> None:
        held["tensors"] = load_file(next(left) / "model.safetensors")

    return step, lambda d: write_model_dir(held["tensors"], config, d)


def delta_rows(
    url: str, near: Path, far: Path, versions: dict[float, list[Path]], repeats: int, warmup: int
) -> dict:
    """bf16 pushes of each learning rate's `versions` in turn (each one AdamW step after the one
    before): by path, over the network whole (`sync.delta: off`) and as deltas (`on`). The timed
    save writes the version's bf16 tensors read before it (untimed: the step), so it leaves out the
    float32 masters' cast to bf16."""
    out = {}
    for lr, dirs in versions.items():
        for name, root, delta in (("path", near, "off"), ("network", far, "off"), ("delta", far, "on")):
            run = f"bf16-{name}-{lr:g}"
            step, write = replay(dirs)
            out[f"bf16_{name}_lr{lr:g}"] = pushes(
                url, root, run, "checkpoint", write, repeats, warmup, delta, step
            )
            shutil.rmtree(root / "weights" / run)
            asyncio.run(forget_all(url, run + "/"))
    return out


def measure(
    label: str,
    model_dir: Path,
    tmp: Path,
    rank: int,
    repeats: int,
    warmup: int,
    extra: tuple[str, ...],
    delta_lrs: list[float] | None = None,
) -> dict:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.learner.lora import attach, write_adapter
    from grpoflow.tasks.push.weights import save_weights

    near, far, server_root = tmp / "near", tmp / "far", tmp / "server"
    for d in (near, far, server_root):
        d.mkdir(parents=True, exist_ok=True)
    if delta_lrs:  # every version first: a 1.5B learner and a server would not fit in memory together
        versions = {
            lr: trained_versions(model_dir, lr, warmup + repeats, tmp / "versions") for lr in delta_lrs
        }
        with safe_open(next(iter(versions.values()))[0] / "model.safetensors", "pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
    row: dict = {"model": label, "params": params, "rank": rank}
    with Hosts(1, prefix="gfb") as (host,):
        cmd, env, url = server_command(
            model_dir, host=host.address, port=PORT, max_model_len=512, kv_cache_gb=1, api_key=KEY,
            lora_rank=LoraConfig(rank=rank).served_rank(), extra_args=extra, upload_dir=server_root / "uploads",
            dtype="bfloat16" if delta_lrs else None,  # bf16 pushes: the server serves what they carry
        )  # fmt: skip
        log = open(tmp / f"{label.replace(':', '-')}.log", "wb")  # noqa: SIM115
        host.run(cmd, hide=[far], env=env, stdout=log, stderr=subprocess.STDOUT)
        host.wait_port(PORT, timeout_s=900)

        async def healthy() -> None:
            async with VLLMClient(url, api_key=KEY) as c:
                await c.wait_healthy(900)

        asyncio.run(healthy())
        if delta_lrs:  # only the bf16 and delta pushes
            row |= delta_rows(url, near, far, versions, repeats, warmup)
            log.close()
            return row
        full = lambda d: save_weights(model, d)  # noqa: E731
        row["full_path"] = pushes(url, near, "full-near", "checkpoint", full, repeats, warmup)
        shutil.rmtree(near / "weights")  # disk: 1.5B versions are 6 GB each
        row["full_network"] = pushes(url, far, "full-far", "checkpoint", full, repeats, warmup)
        latest = max((far / "weights" / "full-far").glob("v*"))
        row |= compression(latest)
        row |= http_floor(host, cmd[0], latest / "model.safetensors", repeats)
        shutil.rmtree(far / "weights")  # disk, on both sides
        asyncio.run(forget_all(url, "full-far/"))
        row["cut_off"] = cut_off_then_push(url, far, full)
        peft_model = attach(model, LoraConfig(rank=rank, alpha=2 * rank))
        with torch.no_grad():  # a non-identity adapter, as a trained one is
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.01)
        adapter = lambda d: write_adapter(peft_model, d)  # noqa: E731
        shutil.rmtree(far / "weights")
        row["adapter_path"] = pushes(url, near, "lora-near", "lora", adapter, repeats, warmup)
        row["adapter_network"] = pushes(url, far, "lora-far", "lora", adapter, repeats, warmup)
        log.close()
    full_mb = row["full_network"]["upload_bytes"] / 1e6
    row["upload_mb_per_s"] = round(full_mb / max(row["full_network"]["upload_seconds_median"], 1e-9), 1)
    row["full_network_over_path"] = round(
        row["full_network"]["push_seconds_median"] / row["full_path"]["push_seconds_median"], 3
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", help="converted SmolLM2-135M model dir")
    ap.add_argument("--random", nargs="*", default=[], choices=["0.5b", "1.5b"], help="random-model shapes")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed pushes of each kind (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed pushes first (default 2: keep_last's)")
    what = "instead: bf16 pushes after one AdamW step at each lr, by path, whole and as deltas"
    ap.add_argument("--delta-lr", nargs="*", type=float, default=[], help=what)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="grpoflow-network-push-"))
    try:
        if args.smollm2:
            row = measure(
                "SmolLM2-135M",
                Path(args.smollm2).resolve(),
                tmp / "smollm2",
                args.rank,
                args.repeats,
                args.warmup,
                (),
                args.delta_lr,
            )
            print(json.dumps(row), flush=True)
        learner_bench = runpy.run_path(str(HERE / "learner.py"), run_name="learner_bench")
        for size in args.random:
            model_dir = tmp / f"random-{size}"
            learner_bench["save_random_model"](size, model_dir)
            row = measure(
                f"random:{size}",
                model_dir,
                tmp / size,
                args.rank,
                args.repeats,
                args.warmup,
                ("--skip-tokenizer-init",),
                args.delta_lr,
            )
            print(json.dumps(row), flush=True)
            shutil.rmtree(model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
