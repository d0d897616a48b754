# One import name (pyproject.toml): this folder is `grpoflow.examples`, never `examples`, which stays free
# for a user's own module of that name (run from the repository, its folder is on the path too).
if __name__ != "grpoflow.examples":
    raise ImportError(f"grpoflow's examples package imports as grpoflow.examples, not {__name__}")
