"""Run on the learner's host by test_hosts_ray.py: one train step of the tiny model by one process and
by two learner ranks on the Ray cluster at argv[1] (one rank per node: SPREAD), compared as
test_distributed.py compares them on one host. Prints one JSON line: the ranks' nodes, the worst weight
difference, and both losses."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import ray

from grpoflow.flows.processes.cluster import runtime_env
from tests.integration.test_distributed import batch, saved_weights, sharded, single, weights


def main(address: str, model_dir: str) -> None:
    ray.init(address=address, runtime_env=runtime_env(None), namespace="grpoflow")
    ref = single(model_dir)
    one = ref.train_step(batch(1))
    d = sharded(model_dir)
    try:
        two = d.train_step(batch(1))
        with tempfile.TemporaryDirectory() as out:  # the ranks write it: a folder every host sees
            d.write_weights(Path(out))
            got = saved_weights(Path(out))
        nodes = d.nodes
    finally:
        d.close()
    want = weights(ref.model.state_dict())
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(json.dumps({"nodes": nodes, "worst": worst, "loss": [one["train/loss"], two["train/loss"]]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
