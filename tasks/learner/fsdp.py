"""A learner rank's part in a sharded model: the process group, FSDP2 sharding, the full weights
gathered for the servers, and torch.distributed.checkpoint in one process.

Outside an initialised process group every helper is the one-process case (rank 0 of 1).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from grpoflow.tasks.push.weights import write_model_dir


def process_group() -> tuple[int, int]:
    """(rank, world size) of this process's torch.distributed group; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(model, device: torch.device, world_size: int) -> None:
    """FSDP2 over the process group: each decoder layer (transformers' `_no_split_modules`) is a
    unit of its own, so one layer's full parameters exist at a time, then the rest of the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def aliases(model) -> list[str]:
    """Names of parameters that are another parameter under a second name (tied embeddings)."""
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append(name)
        seen.add(id(p))
    return out


def write_gathered_weights(model, directory: Path, *, rank: int, skip: list[str], dtype=None) -> None:
    """A sharded model's full weights as a model dir: gathered one parameter at a time onto rank 0's
    CPU (the only full copy), less the `skip` aliases, and written by rank 0. Every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for name in skip:
            full.pop(name, None)
        write_model_dir(full, model.config, directory, dtype)
    del full
    dist.barrier()  # the files exist once every rank returns


def one_process_dcp(world_size: int) -> contextlib.ExitStack:
    """torch.distributed.checkpoint in one process warns that it assumes one process, which is meant."""
    stack = contextlib.ExitStack()
    if world_size == 1:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
    return stack
