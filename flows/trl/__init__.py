"""TRL's names over grpoflow: `from grpoflow.trl import GRPOConfig, GRPOTrainer` in a TRL script or notebook.

A facade, not a second trainer: `GRPOConfig` (TRL 1.16's fields, `args.py`) becomes grpoflow's config
tree, and `GRPOTrainer.train()` (`trainer.py`) runs the `grpo-train` flow with it (the embedded vLLM
server, the store, the explorer). Reward functions, tools and environments defined in the script run in
the training process; a dataset given as an object is written into the run's store (`data.py`); TRL's
reading callbacks and `state.log_history` are fed from the `steps` table (`callbacks.py`).

Installed as `grpoflow.trl` from the folder `flows/trl` (pyproject.toml's package-dir): the facade is an
entry point beside the CLI, and `trl` stays TRL's own name.
"""

if __name__ != "grpoflow.trl":
    raise ImportError(f"grpoflow's TRL facade imports as grpoflow.trl, not {__name__}")

import grpoflow.flows  # noqa: F401  # its import settings (OpenMP's wait policy) before torch's
from grpoflow.trl.args import GRPOConfig
from grpoflow.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
