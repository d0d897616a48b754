# One import name (pyproject.toml): this folder is `grpoflow.flows`, never `flows`, which stays free
# for a user's own module of that name (run from the repository, its folder is on the path too).
if __name__ != "grpoflow.flows":
    raise ImportError(f"grpoflow's flows package imports as grpoflow.flows, not {__name__}")

import os

# On CPU the learner shares its cores with the vLLM server: OpenMP threads that spin while idle
# (the GNU default) made each train step ~2x slower on 2 cores. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
