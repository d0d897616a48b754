"""Run a Python module as `__main__`, and die with the process that started it.

    python -m grpoflow.server.guard PARENT_PID MODULE [ARGS...]

Servers a run starts (the vLLM server with its engine and workers, Prefect's API server, a local Ray)
must not outlive the run, however the run dies: SIGKILL and the OOM killer run no cleanup code. The
caller starts this process as a group leader; `watchdog.watch_parent` kills its whole process group
once the parent is gone, so the engine and worker processes the module spawns go with it. With
GRPOFLOW_GUARD_SESSION=1 it kills the whole session first (a local Ray's workers lead groups of their
own); with GRPOFLOW_OWNED_TMPDIR it removes that folder first (a vLLM server's socket folder).

It runs in the vLLM environment (grpoflow.server installed there on its own) as well as grpoflow's, so
it imports nothing outside this package.
"""

from __future__ import annotations

import os
import runpy
import sys

from grpoflow.server.protocol import GUARD_SESSION_ENV, OWNED_TMPDIR_ENV
from grpoflow.server.watchdog import watch_parent

MODULE = "grpoflow.server.guard"


def command(python: str, parent_pid: int, module: str, args: list[str]) -> list[str]:
    """The argv that runs `python -m module args` under the guard, watching `parent_pid`."""
    return [python, "-m", MODULE, str(parent_pid), module, *args]


def watched_parent(argv: list[str]) -> int | None:
    """The parent pid a guard process watches, read from its command line (`command`); None when
    `argv` is not a guard's."""
    if len(argv) > 3 and argv[1:3] == ["-m", MODULE] and argv[3].isdigit():
        return int(argv[3])
    return None


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: python -m {MODULE} PARENT_PID MODULE [ARGS...]")
    watch_parent(
        int(sys.argv[1]),
        whole_session=os.environ.get(GUARD_SESSION_ENV) == "1",
        remove=os.environ.get(OWNED_TMPDIR_ENV),
    )
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
