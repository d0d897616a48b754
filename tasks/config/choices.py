"""The names a config field picks from, written once: the config's fields and the code that branches
on them (the GRPO math, the weight push, the retrain gate) take their Literal types from here.

Standard library only (`typing`): `tasks/learner/grpo.py` imports it and stays pure math.
"""

from __future__ import annotations

from typing import Literal

# algorithm.*: the loss, the advantage's baseline and scale, the off-policy correction
LossType = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
Baseline = Literal["group_mean", "leave_one_out"]
Scale = Literal["group", "batch", "none"]
Correction = Literal["none", "tis", "icepop", "seq_mask", "seq_tis"]

# learner.device and rewards[].device (a reward model's)
Device = Literal["auto", "cpu", "cuda"]

# sync.backend: the weight push backends (tasks/push/push.py: BACKENDS)
SyncBackend = Literal["checkpoint", "lora", "lora_merged"]
SyncTransport = Literal["auto", "path", "network"]
SyncDelta = Literal["auto", "on", "off"]

# grpo-retrain's gate (flows/lineage/retrain.py) and `grpoflow retrain --metric`
GateMetric = Literal["reward_mean", "pass_rate", "valid_frac"]

# run.report_to: the experiment trackers (flows/viewing/tracking/: one tracker class per name)
TRACKER_NAMES = ("tensorboard", "mlflow", "wandb")
