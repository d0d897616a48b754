"""Run a Python module as `__main__`, and die with the process that started it.

    python grpoflow_guard.py PARENT_PID MODULE [ARGS...]

Servers a run starts (the vLLM server with its engine and workers, Prefect's API server, a local Ray)
must not outlive the run, however the run dies: SIGKILL and the OOM killer run no cleanup code. The
caller starts this process as a group leader; `storage.processes.watch_parent` kills its whole process
group once the parent is gone, so the engine and worker processes the module spawns go with it. With
GRPOFLOW_GUARD_SESSION=1 it kills the whole session first (a local Ray's workers lead groups of their
own).

This script runs in the vLLM environment as well as grpoflow's, and the vLLM one has none of grpoflow's
packages (only psutil, which vLLM depends on). So it loads storage/processes.py by its path, as a
module of its own, instead of importing `storage`: the one watchdog that the process-pool reward
workers use too, and no package of grpoflow's shadowing a name on the server's import path.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path
from types import ModuleType

# flows/vllm_plugins/ -> the folder holding the packages, the repository or site-packages alike
PROCESSES = Path(__file__).resolve().parents[2] / "storage" / "processes.py"


def load_processes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpoflow_processes", PROCESSES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: grpoflow_guard.py PARENT_PID MODULE [ARGS...]")
    whole_session = os.environ.get("GRPOFLOW_GUARD_SESSION") == "1"
    load_processes().watch_parent(int(sys.argv[1]), whole_session=whole_session)
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
