"""The vLLM environment runs what grpoflow hands vLLM from the installed grpoflow.server alone: the guard,
the middlewares and the worker extension (flows/processes/vllm_command.py's own names) import there without any other
part of grpoflow, and every third-party name the package imports is there. No server starts: the
imports are what vLLM does first with them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpoflow.flows.processes.vllm_command import AUTH_MIDDLEWARE, MIDDLEWARES, vllm_python
from grpoflow.server import guard
from grpoflow.server.protocol import WORKER_EXTENSION
from tests.support import server_imports

pytestmark = pytest.mark.integration

# Imports each "module" or "module.object" in argv, then prints the grpoflow modules loaded and which of
# the third-party names given after "--" the environment has. The test's body judges.
PROBE = """
import importlib, importlib.util, json, sys
entries, _, names = " ".join(sys.argv[1:]).partition(" -- ")
for entry in entries.split():
    try:
        importlib.import_module(entry)
    except ModuleNotFoundError:
        module, _, obj = entry.rpartition(".")
        getattr(importlib.import_module(module), obj)
found = {n: importlib.util.find_spec(n) is not None for n in names.split()}
print(json.dumps({"grpoflow": sorted(m for m in sys.modules if m.startswith("grpoflow")), "found": found}))
"""


def test_the_vllm_environment_imports_only_grpoflow_server_and_has_what_it_needs(tmp_path):
    python = vllm_python()
    assert python != sys.executable, "no vLLM environment (.venv-vllm or GRPOFLOW_VLLM_PYTHON): make install"
    entries = [guard.MODULE, *MIDDLEWARES, AUTH_MIDDLEWARE, WORKER_EXTENSION]
    third_party = sorted(
        {n.partition(".")[0] for names in server_imports().values() for n in names}
        - sys.stdlib_module_names
        - {"grpoflow"}
    )
    # Outside the checkout, so that nothing of it is on the path but what is installed.
    out = subprocess.run(
        [python, "-c", PROBE, *entries, "--", *third_party],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert third_party and seen["found"] == dict.fromkeys(third_party, True), seen["found"]
    assert "grpoflow.server.merge" in seen["grpoflow"] and "grpoflow.server.guard" in seen["grpoflow"]
    outside = [m for m in seen["grpoflow"] if m not in ("grpoflow", "grpoflow.server")
               and not m.startswith("grpoflow.server.")]  # fmt: skip
    assert outside == [], outside


# vLLM's sampler ranks each sampled token among the vocabulary with a torch.compile'd op; the probe runs
# it as the sampler does (a batch's dimension unbacked) and prints the ranks and what inductor cached.
RANK_PROBE = """
import json, os, sys, torch
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
logprobs = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
sampled = logprobs.gather(-1, torch.tensor([[4], [9], [30]]))
torch._dynamo.decorators.mark_unbacked(logprobs, 0)
ranks = batched_count_greater_than(logprobs, sampled)
cache = sys.argv[1]
files = [f for _, _, fs in os.walk(cache) for f in fs] if os.path.isdir(cache) else []
print(json.dumps({"ranks": ranks.tolist(), "expected": (logprobs >= sampled).sum(-1).tolist(),
                  "compiled": len(files)}))
"""


def test_an_eager_cpu_server_ranks_sampled_tokens_without_compiling(tmp_path, monkeypatch):
    """The environment an eager CPU server gets (server_command) keeps vLLM's sampler from compiling
    at the first request that asks for logprobs (2.6-3 s of a first step's generation on 2 cores), and
    the ranks are the compiled op's. Without it the same op compiles: the probe sees inductor's files."""
    import grpoflow.flows.processes.vllm_command as command

    monkeypatch.setattr(command, "cpu_only", lambda: True)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    cmd, env, _ = command.server_command("m", port=9, dtype="bfloat16")
    assert "--enforce-eager" in cmd  # bf16 on a CPU runs eager

    def probe(env: dict[str, str], cache) -> dict:
        argv = [vllm_python(), "-c", RANK_PROBE, str(cache)]
        env = env | {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
        out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    eager = probe(env, tmp_path / "eager")
    assert eager["compiled"] == 0 and eager["ranks"] == eager["expected"], eager
    env.pop("TORCH_COMPILE_DISABLE")
    compiled = probe(env, tmp_path / "compiled")
    assert compiled["compiled"] > 0 and compiled["ranks"] == eager["ranks"], compiled
