"""Sync reward and tool functions as Ray tasks (`executor: ray`), cut off at their caller's timeout.

The process joins a cluster first (`flows.processes.cluster.ray_cluster`); Ray is imported only here, inside
the functions, so a run that sets no Ray field never imports it.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from grpoflow.tasks.config.imports import import_object

_REMOTE: Any = None  # the Ray remote function, made on first use (ray.remote needs ray imported)
_LOCK = threading.Lock()
_NODES: dict[str, str] = {}  # Ray node id -> its address (node_address)


def this_node() -> str:
    """Where a call made in this process runs: its Ray node's address once the process has joined a
    cluster (the address Ray's tasks report, so that a run's cells name their nodes alike), else the
    host's name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return node_address()
    return socket.gethostname()


def node_address() -> str:
    """The address of the Ray node this process belongs to, as the node registered it (`ray start
    --node-ip-address`; `ray.util.get_node_ip_address()` guesses one from the routes instead). Looked
    up in the cluster's node table once per node."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    if node not in _NODES:
        _NODES.update({n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()})
    return _NODES.get(node) or ray.util.get_node_ip_address()


def _run(target: str | Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """Worker side. An import path is resolved on the worker, as the process pool does: the module
    comes from the job's runtime environment (flows/processes/cluster.py), and nothing of the user's module
    state has to pickle. A callable given from Python travels by cloudpickle (by reference when its
    module is importable on the worker, by value otherwise, e.g. a closure)."""
    fn = import_object(target) if isinstance(target, str) else target
    try:
        out = fn(**kwargs)
    except Exception as e:  # travels back with its attributes: the caller records where it failed
        e.ray_node = node_address()
        raise
    # numpy arrays and tensors travel as lists; the node's address says where it ran
    return node_address(), out.tolist() if hasattr(out, "tolist") else out


def _remote() -> Any:
    global _REMOTE
    import ray

    with _LOCK:
        if _REMOTE is None:
            # No retries: a reward or tool that crashed its worker failed; running it again would
            # double its cost and side effects, and the thread executor does not retry either.
            _REMOTE = ray.remote(max_retries=0, retry_exceptions=False)(_run)
        return _REMOTE


async def call_on_ray(
    target: str | Callable[..., Any], kwargs: dict[str, Any], num_cpus: float
) -> tuple[Any, str]:
    """`target(**kwargs)` as a Ray task reserving `num_cpus`: its result, and the address of the Ray
    node that ran it. The user's exception is raised as itself, with that address as its `ray_node`.

    Cancelling the awaiting coroutine (its caller's timeout) cancels the task with force=True: Ray
    kills the worker running it, so a hung function holds neither a CPU nor a worker, and Ray starts
    a fresh worker for the next task."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "executor 'ray' needs a Ray cluster, and this process has joined none: set scale.ray_address "
            "(grpo-train and grpo-evaluate connect to it)"
        )
    ref = _remote().options(num_cpus=num_cpus).remote(target, kwargs)
    try:
        node, out = await asyncio.wrap_future(ref.future())
        return out, node
    except asyncio.CancelledError:
        ray.cancel(ref, force=True)
        raise
    except ray.exceptions.RayTaskError as e:
        # Ray wraps the function's exception (its class is a subclass of both); the cell's reason must
        # read `ZeroDivisionError: boom` as with threads, and a TimeoutError the function raised
        # must stay distinguishable from our deadline.
        if isinstance(e.cause, Exception):
            raise e.cause from None
        raise
