# One import name (pyproject.toml): this folder is `grpoflow.storage`, never `storage`, which stays free
# for a user's own module of that name (run from the repository, its folder is on the path too).
if __name__ != "grpoflow.storage":
    raise ImportError(f"grpoflow's storage package imports as grpoflow.storage, not {__name__}")
