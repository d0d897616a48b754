"""The config tree of a grpoflow run: one validated pydantic model, every field documented.

Only flows see the whole tree; each unit below takes its own section (`tasks/config/`, a module per
subsystem). Validation fails early (before any model is loaded) with the dotted path of the offending
field.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from grpoflow.tasks.config.algorithm import AlgorithmConfig, WarmupConfig
from grpoflow.tasks.config.allowlist import NotAllowedError, check_path
from grpoflow.tasks.config.data import DataConfig, DatasetConfig
from grpoflow.tasks.config.imports import add_search_dir, import_object
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.config.learner import LearnerConfig, LoraConfig
from grpoflow.tasks.config.model import ModelConfig
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.config.run import RunConfig, ScaleConfig, StorageConfig, TrackingConfig
from grpoflow.tasks.config.section import Section
from grpoflow.tasks.models import is_template_text

__all__ = [  # the sections, re-exported: user code builds a GRPOConfig from them
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "GRPOConfig",
    "GenerationConfig",
    "InferenceConfig",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RunConfig",
    "ScaleConfig",
    "StorageConfig",
    "SyncConfig",
    "ToolsConfig",
    "TrackingConfig",
    "WarmupConfig",
    "load_config",
]


class GRPOConfig(Section):
    """The whole run: what to train, on what, how, and where it lands."""

    _config_dir: Path | None = PrivateAttr(None)  # set by load_config only: not a field of the file

    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollouts.")
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(name="letter", fn="grpoflow.examples.rewards:letter_fraction")],
        min_length=1,
        description="Reward functions (at least one).",
    )
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tools and environments.")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="Supervised warm-up before RL.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="GRPO variant.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Optimisation.")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="vLLM server.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight push to vLLM.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Where data lands.")
    scale: ScaleConfig = Field(default_factory=ScaleConfig, description="Ray for rewards and tools.")
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and length.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Settings of the trackers in run.report_to."
    )

    @property
    def config_dir(self) -> Path | None:
        """The folder of the YAML file this config was loaded from (None when built in Python): where
        its relative paths and the user's modules are found (and what Ray workers are shipped)."""
        return self._config_dir

    @model_validator(mode="after")
    def _on_policy_pushes_every_step(self) -> GRPOConfig:
        if self.algorithm.max_staleness == 0 and self.sync.sync_every > 1:
            raise ValueError(
                f"algorithm.max_staleness 0 (on-policy) needs sync.sync_every 1, got "
                f"sync.sync_every {self.sync.sync_every}: pushing less often trains on samples up to "
                f"{self.sync.sync_every - 1} steps old; set algorithm.max_staleness >= 1 to allow that"
            )
        return self

    @model_validator(mode="after")
    def _eval_needs_a_split(self) -> GRPOConfig:
        every, d = self.run.eval_every, self.data
        if every and not (
            d.eval_path or d.eval_fraction or d.eval_split or d.eval_generator_kwargs is not None
        ):
            raise ValueError(
                f"run.eval_every {every} needs a held-out split to score: set data.eval_path, "
                "data.eval_fraction, data.eval_split or data.eval_generator_kwargs"
            )
        if every and every % self.sync.sync_every:
            raise ValueError(
                f"run.eval_every {every} must be a multiple of sync.sync_every {self.sync.sync_every}: the "
                "eval scores the weights the servers hold, which change only at a push"
            )
        return self

    @model_validator(mode="after")
    def _mini_batches_fit_the_batch(self) -> GRPOConfig:
        n = self.data.prompts_per_step * self.generation.group_size
        if self.learner.mini_batches > n:
            raise ValueError(
                f"learner.mini_batches {self.learner.mini_batches} is more than a step's {n} completions "
                f"(data.prompts_per_step x generation.group_size)"
            )
        return self

    @field_validator("generation")
    @classmethod
    def _groups_to_compare(cls, v: GenerationConfig) -> GenerationConfig:
        if v.group_size < 2:
            raise ValueError(
                f"generation.group_size: GRPO compares completions within a group, so it needs at least "
                f"2 per prompt, got {v.group_size}"
            )
        if v.temperature <= 0:
            raise ValueError(
                "generation.temperature: training samples, so it needs a temperature above 0 (greedy "
                "decoding is for evaluation: grpoflow evaluate --greedy)"
            )
        return v

    @model_validator(mode="after")
    def _ray_needs_a_cluster(self) -> GRPOConfig:
        if self.scale.ray_address is None:
            asks = [
                f"rewards[{i}].executor is 'ray'" for i, r in enumerate(self.rewards) if r.executor == "ray"
            ]
            asks += ["tools.executor is 'ray'"] if self.tools.executor == "ray" else []
            if self.learner.world_size > 1:
                asks.append(f"learner.world_size is {self.learner.world_size} (its ranks are Ray actors)")
            if asks:
                raise ValueError(
                    f"{asks[0]} but scale.ray_address is not set: set it to 'local' (a Ray started for "
                    "the run on this machine) or to a cluster's address"
                )
        return self

    @model_validator(mode="after")
    def _lora_pushes_adapters(self) -> GRPOConfig:
        lora, backend = self.learner.lora is not None, self.sync.backend
        if lora and self.learner.world_size > 1:
            raise ValueError(
                f"learner.lora: the sharded learner (learner.world_size {self.learner.world_size}) does not "
                "train adapters; set learner.world_size 1 or leave learner.lora unset"
            )
        if backend == "checkpoint" and lora:
            raise ValueError(
                "sync.backend 'checkpoint' pushes the whole model, but learner.lora trains an adapter: "
                "set sync.backend 'lora' (or 'lora_merged') or leave it unset"
            )
        if backend in ("lora", "lora_merged") and not lora:
            raise ValueError(f"sync.backend {backend!r} pushes an adapter, but learner.lora is not set")
        if backend is None:
            self.sync.backend = "lora" if lora else "checkpoint"
        return self

    @model_validator(mode="after")
    def _reproducible_on_one_server(self) -> GRPOConfig:
        servers = len(self.inference.external()) or self.inference.replicas
        if self.run.reproducible and servers > 1:
            field = "inference.urls" if self.inference.urls else "inference.replicas"
            raise ValueError(
                f"run.reproducible needs one server, but {field} names {servers}: which server a group "
                "goes to follows their timing, and each has its own threads and version; use one server "
                "or unset run.reproducible"
            )
        return self

    @model_validator(mode="after")
    def _some_prompts(self) -> GRPOConfig:
        d = self.data
        if not d.path and d.dataset is None and not d.generator and self.tools.environment is None:
            raise ValueError(
                "data: set data.path, data.dataset or data.generator, or tools.environment (with no dataset, "
                "its reset() gives the prompts)"
            )
        return self

    @model_validator(mode="after")
    def _unique_rewards(self) -> GRPOConfig:
        names = [r.name for r in self.rewards]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rewards: duplicate names {dupes}")
        return self


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path."""


def resolve_import(path: str, field: str) -> Any:
    """Import 'module:attr' or raise ConfigError naming the config field."""
    try:
        return import_object(path)
    except NotAllowedError as e:
        raise ConfigError(f"{field}: refused: {e}") from e
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{field}: cannot import {path!r}: {type(e).__name__}: {e}") from e


def set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    d[parts[-1]] = value


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict[str, Any] | None = None
) -> GRPOConfig:
    """Parse a YAML file plus `key.sub=value` overrides (values parsed as YAML) into a GRPOConfig;
    without a file the overrides apply to `base` (a config tree, e.g. a run's recorded one)."""
    raw: dict[str, Any] = copy.deepcopy(base) if base is not None else {}
    if path is not None:
        try:
            check_path(path, "config_file")  # a worker-started run reads only inside its allowed roots
        except NotAllowedError as e:
            raise ConfigError(str(e)) from None
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        raw = yaml.safe_load(p.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        set_dotted(raw, key.strip(), yaml.safe_load(value))
    if path is not None:
        _names_its_task(raw, path)
    cfg = validate_config(raw, f" in {path}" if path else "")
    if path is not None:
        here = Path(path).resolve().parent
        add_search_dir(here)  # the user's reward/tool/environment modules beside their config
        cfg._config_dir = here
        cfg.data.path = _beside_config(cfg.data.path, here)
        cfg.data.eval_path = _beside_config(cfg.data.eval_path, here)
        if cfg.data.dataset is not None:
            _dataset_beside_config(cfg.data.dataset, here)
        if cfg.model.path != "tiny":
            cfg.model.path = _beside_config(cfg.model.path, here)
        if cfg.model.chat_template is not None and not is_template_text(cfg.model.chat_template):
            cfg.model.chat_template = _beside_config(cfg.model.chat_template, here)
        for r in cfg.rewards:
            r.model = _beside_config(r.model, here)
    return cfg


def validate_config(raw: dict[str, Any], where: str = "") -> GRPOConfig:
    """The tree `raw` (not copied: objects given from Python stay those objects), or a ConfigError with
    a line per invalid field."""
    try:
        return GRPOConfig.model_validate(raw)
    except ValidationError as e:
        lines = [_error_line(err) for err in e.errors()]
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(lines)) from None


# Where a config's rows come from: one of these in `data` (the defaults are the letters demo's generator).
DATA_SOURCES = ("path", "dataset", "generator")


def _names_its_task(raw: dict[str, Any], path: str | Path) -> None:
    """A config file (with its --set overrides) must name its rewards and its data: the defaults are the
    tiny demo's, which a user's model must never silently train on. `grpoflow train` with no config
    file still runs the demo."""
    tools = raw.get("tools") if isinstance(raw.get("tools"), dict) else {}
    if tools.get(
        "verifiers"
    ):  # a verifiers environment brings its rows and rewards (flows/training/environments.py)
        return
    env = tools.get("environment")
    if not raw.get("rewards") and not env:  # an environment's get_reward() may be its reward
        raise ConfigError(
            f"{path}: rewards: the config names no reward; a config file says what it trains for "
            "(the demo's letter reward is the default only without --config)"
        )
    data = raw.get("data")
    owned = (
        env and isinstance(data, dict) and "generator" in data and not any(data.get(k) for k in DATA_SOURCES)
    )
    if not owned and (not isinstance(data, dict) or not any(data.get(k) for k in DATA_SOURCES)):
        raise ConfigError(
            f"{path}: data: the config names no rows (data.path, data.dataset or data.generator; "
            "data.generator: null for an environment whose reset() gives the prompts); the demo's "
            "letter rows are the default only without --config"
        )


def _error_line(err: dict[str, Any]) -> str:
    """`field.path: message`; a validator's message that already starts with its field path is kept
    as it is."""
    where = ".".join(str(x) for x in err["loc"]) or "<root>"
    msg = err["msg"].removeprefix("Value error, ")
    return msg if msg.startswith(f"{where}.") else f"{where}: {msg}"


def _beside_config(value: str | None, config_dir: Path) -> str | None:
    """A relative path that does not exist under the current directory is looked up next to the
    config file (when it is in neither place, preflight's error names both)."""
    if value is None or Path(value).is_absolute() or Path(value).exists():
        return value
    beside = config_dir / value
    return str(beside) if beside.exists() else value


def _dataset_beside_config(ds: DatasetConfig, config_dir: Path) -> None:
    """`data.dataset.path` and, for a builder (json, parquet, ...), its `data_files`, looked up like
    `data.path`. A builder name stays as it is; so do the data_files of a dataset directory or a Hub
    name (datasets reads those relative to the dataset itself)."""
    if not ds.is_builder():
        ds.path = _beside_config(ds.path, config_dir) or ds.path
        return
    f = ds.data_files
    if isinstance(f, str):
        ds.data_files = _beside_config(f, config_dir)
    elif isinstance(f, list):
        ds.data_files = [_beside_config(x, config_dir) or x for x in f]
    elif isinstance(f, dict):
        ds.data_files = {
            k: _beside_config(v, config_dir)
            if isinstance(v, str)
            else [_beside_config(x, config_dir) or x for x in v]
            for k, v in f.items()
        }


def where_searched(cfg: GRPOConfig, value: str) -> str:
    """The places a relative path was looked for, for a not-found error."""
    places = [str(Path.cwd() / value)]
    if cfg.config_dir is not None and not Path(value).is_absolute():
        places.append(str(cfg.config_dir / value))
    return " nor ".join(places)


def check_imports(cfg: GRPOConfig) -> None:
    """Resolve every import path now, so a typo fails before any model is loaded (callables given
    from Python are already resolved). A run's environments, MCP servers and verifiers environment are
    checked beside this, by `check_run` (flows/training/environments.py), which calls this first: the
    config tree imports nothing of the flows that read it."""
    for i, r in enumerate(cfg.rewards):
        if isinstance(r.fn, str):
            resolve_import(r.fn, f"rewards[{i}].fn")
    for i, t in enumerate(cfg.tools.tools):
        if isinstance(t, str):
            resolve_import(t, f"tools.tools[{i}]")
    if cfg.data.generator and not cfg.data.path and cfg.data.dataset is None and cfg.tools.verifiers is None:
        resolve_import(cfg.data.generator, "data.generator")
    if isinstance(cfg.warmup.examples, str):
        resolve_import(cfg.warmup.examples, "warmup.examples")
