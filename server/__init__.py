"""grpoflow's code inside the vLLM server: the guard that starts it, its middlewares and its worker
extension, and the wire protocol the client shares with them (protocol.py).

A leaf: nothing here imports the rest of grpoflow, because the vLLM environment has only this package
installed (server/pyproject.toml, `pip install --no-deps -e server`; `make install` does it).
tests/unit/test_server_package.py checks every import of every module against the two lists below.
"""

# One import name (pyproject.toml): this folder is `grpoflow.server`, never `server`, which stays free
# for a user's own module of that name.
if __name__ != "grpoflow.server":
    raise ImportError(f"grpoflow's server package imports as grpoflow.server, not {__name__}")

# Installed with the package: server/pyproject.toml's `dependencies` (a test keeps the two equal).
REQUIRES = ("psutil",)  # watchdog.py (vLLM depends on it too, but grpoflow does not rely on that)
# The vLLM environment's own, imported only inside the worker extension's functions (merge.py,
# invariant.py, reload.py), which run in vLLM's worker processes: never a dependency of the package.
PROVIDED_BY_VLLM = ("safetensors", "torch", "vllm")
