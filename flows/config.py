"""The config tree of a grpoflow run: one validated pydantic model, every field documented.

Only flows see this tree; tasks receive flat, typed arguments taken from it. Validation fails early
(before any model is loaded) with the dotted path of the offending field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from storage.records import validate_run_id
from tasks.allowlist import NotAllowedError, check_path
from tasks.imports import add_search_dir, import_object


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field(
        "tiny",
        description="Local model directory (config, safetensors, tokenizer). 'tiny' builds a random "
        "tiny Llama + byte-level tokenizer under <root>/models/tiny (tests and demo).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Learner dtype: auto = float32 on CPU, bfloat16 on GPU."
    )


class DataConfig(_Section):
    path: str | None = Field(None, description="JSONL or Parquet file of rows; each row needs 'prompt'.")
    generator: str | None = Field(
        "examples.envs:letters_rows",
        description="Import path 'module:function' returning a list of rows; used when path is unset.",
    )
    generator_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the generator."
    )
    prompts_per_step: int = Field(8, ge=1, description="Dataset rows (groups) per training step.")
    shuffle: bool = Field(True, description="Shuffle rows each epoch (seeded by run.seed).")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if not self.path and not self.generator:
            raise ValueError("set data.path or data.generator")
        return self


class GenerationConfig(_Section):
    group_size: int = Field(8, ge=2, description="Completions per prompt (G); GRPO needs at least 2.")
    max_tokens: int = Field(16, ge=1, description="Max new tokens per generation turn.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the learner uses it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_turns: int = Field(1, ge=1, description="Max model turns per rollout (tool calls in between).")
    max_rollout_tokens: int | None = Field(
        None, ge=1, description="Token budget over all turns of one rollout (None: max_tokens*max_turns)."
    )
    max_in_flight: int = Field(64, ge=1, description="Bound on concurrent generation requests.")


class RewardConfig(_Section):
    name: str = Field(..., min_length=1, description="Name of the reward in tables and metrics.")
    fn: str = Field(..., description="Import path 'module:function' of the reward function.")
    weight: float = Field(1.0, description="Weight in the total reward.")
    timeout_s: float = Field(30.0, gt=0, description="Per-batch timeout; over it the cells are 'timeout'.")
    executor: Literal["thread", "process"] = Field(
        "thread", description="Where sync functions run: thread pool or process pool (CPU-bound)."
    )
    required: bool = Field(
        True,
        description="If not valid, the completion is masked out of the loss. An optional reward "
        "(false) that is invalid, failed or timed out counts as the mean of its valid values in the "
        "same group, over completions whose required rewards are valid (nothing if there are none), "
        "so it neither helps nor hurts the completion's advantage; the cell keeps its status and "
        "reason and is marked `imputed`.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments.")

    @field_validator("fn")
    @classmethod
    def _import_path(cls, v: str) -> str:
        return _check_import_path(v)


class ToolsConfig(_Section):
    tools: list[str] = Field(default_factory=list, description="Tool functions, 'module:function'.")
    environment: str | None = Field(
        None,
        description="Environment factory 'module:Class'; its public methods become tools. Each finished "
        "rollout's environment reaches the reward functions as an isolated snapshot: the environment's "
        "own snapshot() when it defines one, else a deep copy.",
    )
    env_slots: int | None = Field(None, ge=1, description="Pooled environment instances (None: in-flight).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Timeout of one tool call.")

    @field_validator("tools")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_check_import_path(p) for p in v]

    @field_validator("environment")
    @classmethod
    def _env_path(cls, v: str | None) -> str | None:
        return None if v is None else _check_import_path(v)


class AlgorithmConfig(_Section):
    loss_type: Literal["grpo", "dr_grpo", "dapo", "gspo"] = Field("grpo", description="Loss variant.")
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the ratio.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip range (None: epsilon).")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference model (k3); 0 = none.")
    scale: Literal["group", "batch", "none"] = Field("group", description="Advantage std scaling.")
    filter_zero_std: bool = Field(False, description="Drop groups whose valid rewards are all equal.")
    correction: Literal["none", "tis", "icepop", "seq_mask"] = Field(
        "tis", description="Off-policy correction against vLLM's behaviour logprobs."
    )
    correction_cap: float = Field(2.0, gt=1, description="Cap / band of the importance weights.")
    max_staleness: int = Field(
        1,
        ge=0,
        description="Batches generated ahead of training; 0 = synchronous on-policy (needs "
        "sync.sync_every 1). A sample's staleness is the number of training steps between the policy "
        "that generated it and the policy trained on it; the pipeline keeps it at most max_staleness + "
        "sync.sync_every - 1, and a group staler than that (e.g. delayed by a server restart) is "
        "dropped, stored with its reason.",
    )


class LearnerConfig(_Section):
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR decay.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward (grad accum).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Learner device.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None: leave torch's default)."
    )
    share_prompt: bool | None = Field(
        None,
        description="Run each group's prompt once and reuse its KV cache for the group's completions "
        "(same update, fewer FLOPs; None: on for models of 20M+ parameters).",
    )


class InferenceConfig(_Section):
    url: str | None = Field(None, description="vLLM server URL; None starts an embedded server.")
    api_key: str | None = Field(None, description="Bearer key for the server (required off loopback).")
    host: str = Field("127.0.0.1", description="Embedded server bind address.")
    port: int | None = Field(None, ge=1, le=65535, description="Embedded server port (None: free port).")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size of the embedded CPU server (GiB).")
    max_model_len: int = Field(1024, ge=16, description="Max context length of the embedded server.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Wait this long for /health.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generation request.")
    retries: int = Field(4, ge=0, description="Retries on connection errors, timeouts and 5xx.")
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM server flags.")


class SyncConfig(_Section):
    backend: Literal["checkpoint"] = Field("checkpoint", description="Weight push backend.")
    sync_every: int = Field(
        1,
        ge=1,
        description="Push weights to vLLM every N training steps: fewer pushes, samples up to N - 1 "
        "steps staler (see algorithm.max_staleness).",
    )
    keep_last: int = Field(2, ge=1, description="Pushed weight versions kept on disk.")
    reload_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds one weight reload into vLLM may take before the push fails (the server is "
        "resumed either way). Generous: a large model from a slow disk takes minutes.",
    )


class StorageConfig(_Section):
    root: str = Field("runs", description="Store root: rollouts, rewards, steps, checkpoints, weights.")


class RunConfig(_Section):
    run_id: str | None = Field(None, description="Run name (None: generated); [A-Za-z0-9._-].")
    steps: int = Field(20, ge=1, description="Training steps of this run (total, including resumed).")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept per run.")
    seed: int = Field(0, description="Seed of data order, sampling and initialisation.")

    @field_validator("run_id")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return None if v is None else validate_run_id(v)


class GRPOConfig(_Section):
    """The whole run: what to train, on what, how, and where it lands."""

    _config_dir: Path | None = PrivateAttr(None)  # folder of the YAML file it was loaded from

    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollouts.")
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(name="letter", fn="examples.rewards:letter_fraction")],
        min_length=1,
        description="Reward functions (at least one).",
    )
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tools and environments.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="GRPO variant.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Optimisation.")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="vLLM server.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight push to vLLM.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Where data lands.")
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and length.")

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
    def _unique_rewards(self) -> GRPOConfig:
        names = [r.name for r in self.rewards]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rewards: duplicate names {dupes}")
        return self


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path."""


def _check_import_path(v: str) -> str:
    if ":" not in v or not all(v.split(":", 1)):
        raise ValueError(f"expected an import path 'module:attribute', got {v!r}")
    return v


def resolve_import(path: str, field: str) -> Any:
    """Import 'module:attr' or raise ConfigError naming the config field."""
    try:
        return import_object(path)
    except NotAllowedError as e:
        raise ConfigError(f"{field}: refused: {e}") from e
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{field}: cannot import {path!r}: {type(e).__name__}: {e}") from e


def check_environment(factory: Any, path: str) -> None:
    """An environment must snapshot in isolation (its own `snapshot()`, or a deep copy): a shallow copy
    would share state with the pooled instance that the next rollout resets."""
    import copy

    try:
        env = factory()
    except Exception as e:
        raise ConfigError(f"tools.environment: {path}() failed: {type(e).__name__}: {e}") from e
    if callable(getattr(env, "snapshot", None)):
        return
    try:
        copy.deepcopy(env)
    except Exception as e:
        raise ConfigError(
            f"tools.environment: {path} instances cannot be deep-copied ({type(e).__name__}: {e}); "
            "define a snapshot() method that returns an isolated copy of the state your reward "
            "functions read"
        ) from e


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    d[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> GRPOConfig:
    """Parse a YAML file plus `key.sub=value` overrides (values parsed as YAML) into a GRPOConfig."""
    raw: dict[str, Any] = {}
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
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
    try:
        cfg = GRPOConfig.model_validate(raw)
    except ValidationError as e:
        lines = [f"{'.'.join(str(x) for x in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors()]
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(lines)) from None
    if path is not None:
        here = Path(path).resolve().parent
        add_search_dir(here)  # the user's reward/tool/environment modules beside their config
        cfg._config_dir = here
        cfg.data.path = _beside_config(cfg.data.path, here)
        if cfg.model.path != "tiny":
            cfg.model.path = _beside_config(cfg.model.path, here)
    return cfg


def _beside_config(value: str | None, config_dir: Path) -> str | None:
    """A relative path that does not exist under the current directory is looked up next to the
    config file (when it is in neither place, preflight's error names both)."""
    if value is None or Path(value).is_absolute() or Path(value).exists():
        return value
    beside = config_dir / value
    return str(beside) if beside.exists() else value


def where_searched(cfg: GRPOConfig, value: str) -> str:
    """The places a relative path was looked for, for a not-found error."""
    places = [str(Path.cwd() / value)]
    if cfg._config_dir is not None and not Path(value).is_absolute():
        places.append(str(cfg._config_dir / value))
    return " nor ".join(places)


def check_imports(cfg: GRPOConfig) -> None:
    """Resolve every import path now, so a typo fails before any model is loaded."""
    for i, r in enumerate(cfg.rewards):
        resolve_import(r.fn, f"rewards[{i}].fn")
    for i, t in enumerate(cfg.tools.tools):
        resolve_import(t, f"tools.tools[{i}]")
    if cfg.tools.environment:
        check_environment(resolve_import(cfg.tools.environment, "tools.environment"), cfg.tools.environment)
    if cfg.data.generator and not cfg.data.path:
        resolve_import(cfg.data.generator, "data.generator")
