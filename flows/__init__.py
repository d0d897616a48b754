import os

# On CPU the learner shares its cores with the vLLM server: OpenMP threads that spin while idle
# (the GNU default) made each train step ~2x slower on 2 cores. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
