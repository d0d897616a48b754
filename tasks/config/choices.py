"""Names a config field chooses from, each written once: the field's `Literal[...]` and the code that
acts on the choice both read it from here."""

from __future__ import annotations

# `run.report_to`: the experiment trackers (flows/tracking/: one tracker class per name).
TRACKER_NAMES = ("tensorboard", "mlflow", "wandb")
