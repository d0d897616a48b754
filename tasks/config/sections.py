"""The config sections of a grpoflow run: one pydantic model per unit, every field documented.

Each unit takes its own section (the learner its `LearnerConfig` and `AlgorithmConfig`, generation its
`GenerationConfig` and `ToolsConfig`, scoring its `RewardConfig`s); only flows see the whole tree
(`flows.config.GRPOConfig`), which assembles these sections and validates across them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from grpoflow.storage.ids import validate_run_id
from grpoflow.tasks.config.choices import TRACKER_NAMES


class Section(BaseModel):
    """The base of every config section and of the whole tree: unknown keys (typos) are errors, and
    so is an assignment of a bad value after validation (`cfg.learner.lr = -1`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="Local model directory (config, safetensors, tokenizer). 'tiny' builds a random "
        "tiny Llama + byte-level tokenizer under <root>/models/tiny (tests and demo).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Learner compute dtype: auto = float32 on CPU, bfloat16 on GPU. bfloat16 computes under "
        "autocast over float32 master weights and optimizer state; pushes are written in it.",
    )


# datasets' packaged builders: a `data.dataset.path` naming one is a loader, not a file or directory.
HF_BUILDERS = frozenset(
    {"arrow", "audiofolder", "csv", "imagefolder", "json", "pandas", "parquet", "pdffolder", "sql", "text",
     "videofolder", "webdataset", "xml"}
)  # fmt: skip


class DatasetConfig(Section):
    """A Hugging Face dataset, loaded by `datasets.load_dataset(path, name, split=, data_files=)`."""

    path: str = Field(
        ...,
        min_length=1,
        description="What datasets.load_dataset loads: a builder (json, parquet, csv, ...) with "
        "data_files, a local dataset directory (one written by save_to_disk is read with load_from_disk), "
        "or a Hub name: that needs network access, except for a dataset already in the local HF cache "
        "(which works offline, e.g. with HF_DATASETS_OFFLINE=1). Needs pip install 'grpoflow[datasets]'.",
    )
    name: str | None = Field(None, description="The dataset's configuration name (load_dataset's `name`).")
    split: str = Field(
        "train",
        min_length=1,
        description="The split to train on (load_dataset's slicing, e.g. 'train[:1000]', works except for a "
        "save_to_disk directory).",
    )
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        None,
        description="Files for a builder: a path, a list of paths, or {split: path(s)}. Relative to the "
        "current directory, else to the config file's; relative to `path` when that is a directory.",
    )

    def is_builder(self) -> bool:
        """Whether `path` names one of datasets' packaged builders (json, parquet, ...), not a path."""
        return self.path in HF_BUILDERS

    def file_list(self) -> list[str]:
        """Every entry of `data_files`, flattened."""
        f = self.data_files
        if f is None:
            return []
        if isinstance(f, dict):
            return [x for v in f.values() for x in ([v] if isinstance(v, str) else v)]
        return [f] if isinstance(f, str) else list(f)


class DataConfig(Section):
    path: str | None = Field(
        None,
        description="JSONL or Parquet file of rows, or a directory written by datasets' "
        "Dataset.save_to_disk / DatasetDict.save_to_disk; each row needs 'prompt'.",
    )
    dataset: DatasetConfig | None = Field(
        None,
        description="A Hugging Face dataset (datasets.load_dataset) instead of data.path or data.generator.",
    )
    split: str = Field(
        "train",
        min_length=1,
        description="The split to train on when data.path is a DatasetDict directory (data.dataset uses "
        "data.dataset.split).",
    )
    generator: str | None = Field(
        "grpoflow.examples.envs:letters_rows",
        description="Import path 'module:function' returning a list of rows; used when path is unset.",
    )
    generator_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the generator."
    )
    prompts_per_step: int = Field(8, ge=1, description="Dataset rows (groups) per training step.")
    shuffle: bool = Field(True, description="Shuffle rows each epoch (seeded by run.seed).")
    eval_path: str | None = Field(
        None,
        description="JSONL or Parquet file of held-out eval rows (grpo-evaluate's default rows); training "
        "rows with the same id (their `id` field, else a hash of the row) are never trained on.",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Hold out this fraction of the rows for evaluation, chosen by a hash of each row's id: "
        "the same rows stay held out across runs, resumes and data growth (0: none).",
    )
    eval_split: str | None = Field(
        None,
        description="A split of the same Hugging Face dataset (data.dataset, or a DatasetDict directory in "
        "data.path) whose rows are the eval rows, handled like data.eval_path.",
    )
    eval_generator_kwargs: dict[str, Any] | None = Field(
        None,
        description="With data.generator: the eval rows are the generator's rows for generator_kwargs updated "
        "by these (e.g. {part: eval}), handled like data.eval_path.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        # generator has a default: a path or a dataset takes precedence over it
        if self.path and self.dataset:
            raise ValueError("data.dataset: set data.path or data.dataset, not both")
        if not self.path and not self.dataset and not self.generator:
            raise ValueError("set data.path, data.dataset or data.generator")
        if self.eval_path and self.eval_fraction:
            raise ValueError("set data.eval_path or data.eval_fraction, not both")
        for other in ("eval_path", "eval_fraction"):
            if self.eval_split and getattr(self, other):
                raise ValueError(f"data.eval_split: set data.eval_split or data.{other}, not both")
        if self.eval_generator_kwargs is not None:
            if self.path or self.dataset:
                raise ValueError(
                    "data.eval_generator_kwargs: needs data.generator (not data.path or data.dataset)"
                )
            for other in ("eval_path", "eval_fraction", "eval_split"):
                if getattr(self, other):
                    raise ValueError(f"data.eval_generator_kwargs: set it or data.{other}, not both")
        if self.eval_split and not self.path and not self.dataset:
            raise ValueError("data.eval_split: needs data.dataset or a DatasetDict directory in data.path")
        return self


class GenerationConfig(Section):
    group_size: int = Field(
        8, ge=1, description="Completions per prompt (G); training needs at least 2 (evaluation may use 1)."
    )
    max_tokens: int = Field(16, ge=1, description="Max new tokens per generation turn.")
    temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature (the learner uses it too); 0 = greedy, for evaluation only.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_turns: int = Field(1, ge=1, description="Max model turns per rollout (tool calls in between).")
    max_rollout_tokens: int | None = Field(
        None, ge=1, description="Token budget over all turns of one rollout (None: max_tokens*max_turns)."
    )
    max_in_flight: int = Field(64, ge=1, description="Bound on concurrent generation requests.")


class RewardConfig(Section):
    name: str = Field(..., min_length=1, description="Name of the reward in tables and metrics.")
    fn: str | SkipJsonSchema[Callable[..., Any]] | None = Field(
        None,
        description="Import path 'module:function' of the reward function (from Python also the "
        "callable itself, e.g. an nn.Module reward model). Set `fn` or `model`.",
    )
    model: str | None = Field(
        None,
        description="A reward model instead of `fn`: a local directory holding an "
        "AutoModelForSequenceClassification and its tokenizer. It scores prompt + completion (through "
        "its own chat template when the prompts are conversational), logit 0 per completion; loaded "
        "once per run.",
    )
    batch_size: int = Field(8, ge=1, description="Completions per forward pass of a reward `model`.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where a reward `model` runs: auto = cuda when available, else cpu."
    )
    completions: Literal["text", "messages"] = Field(
        "text",
        description="How `completions` and `prompts` reach the function. text: the completion's text. "
        "messages: as TRL passes them: for a conversational prompt, the completion's messages (the "
        "assistant message; with tools every message after the prompt: assistant turns with their "
        "`tool_calls`, tool results) and the prompt as its message list; plain-text prompts stay text.",
    )
    weight: float = Field(1.0, description="Weight in the total reward.")
    timeout_s: float = Field(30.0, gt=0, description="Per-batch timeout; over it the cells are 'timeout'.")
    executor: Literal["thread", "process", "ray"] = Field(
        "thread",
        description="Where sync functions run: thread pool, process pool (CPU-bound), or Ray tasks on the "
        "cluster of scale.ray_address (`environments` arrive as None in a process or on Ray; async "
        "functions always run locally).",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs one call reserves on Ray (executor: ray).")
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
    def _import_path(cls, v: Any) -> Any:
        return _check_import_path(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _fn_or_model(self) -> RewardConfig:
        if (self.fn is None) == (self.model is None):
            raise ValueError(
                f"reward {self.name!r}: set exactly one of fn (a function) and model (a reward model)"
            )
        if self.model is not None and self.executor != "thread":
            raise ValueError(f"reward {self.name!r}: a reward model runs in this process (executor 'thread')")
        return self


class ToolsConfig(Section):
    tools: list[str | SkipJsonSchema[Callable[..., Any]]] = Field(
        default_factory=list,
        description="Tool functions, 'module:function' (from Python also the functions themselves).",
    )
    environment: str | SkipJsonSchema[Callable[..., Any]] | None = Field(
        None,
        description="Environment factory 'module:Class' (from Python also the class); its public methods "
        "become tools. Each finished "
        "rollout's environment reaches the reward functions as an isolated snapshot: the environment's "
        "own snapshot() when it defines one, else a deep copy.",
    )
    env_slots: int | None = Field(None, ge=1, description="Pooled environment instances (None: in-flight).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Timeout of one tool call.")
    executor: Literal["thread", "ray"] = Field(
        "thread",
        description="Where sync tool functions run: a thread, or a Ray task on the cluster of "
        "scale.ray_address. Environment methods and async tools always run locally.",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs one tool call reserves on Ray (executor: ray).")
    describe_tools: Literal["auto", "system", "template"] = Field(
        "auto",
        description="Where the model is told its tools and the call format: 'template' = the chat "
        "template's own rendering of `tools=`; 'system' = grpoflow writes them (and the format the tool "
        "call parser reads) into the system turn; 'auto' = 'system' when the chat template ignores "
        "`tools=` (SmolLM2's does), else 'template'.",
    )

    @field_validator("tools")
    @classmethod
    def _paths(cls, v: list[Any]) -> list[Any]:
        return [_check_import_path(p) if isinstance(p, str) else p for p in v]

    @field_validator("environment")
    @classmethod
    def _env_path(cls, v: Any) -> Any:
        return _check_import_path(v) if isinstance(v, str) else v


class WarmupConfig(Section):
    """Supervised fine-tuning before RL, for a model that never does what the reward needs (a model
    that never writes a tool call gets no tool-call signal to learn from). Run once per model and
    settings, cached under the store root; keep it short of saturation so RL has room to improve."""

    examples: str | SkipJsonSchema[Callable[..., Any]] | None = Field(
        None,
        description="'module:function' returning SFT examples: rows with 'prompt' (as data rows) and "
        "'reply' (the assistant's text, or the messages that follow the prompt: assistant turns are "
        "learned, tool turns are context). Prompts get the tools exactly as rollouts do.",
    )
    examples_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for it.")
    steps: int = Field(0, ge=0, description="SFT optimizer steps (0 = no warm-up).")
    batch_size: int = Field(8, ge=1, description="Examples per SFT step.")
    lr: float = Field(1e-4, gt=0, description="SFT learning rate (AdamW, constant).")

    @field_validator("examples")
    @classmethod
    def _import_path(cls, v: Any) -> Any:
        return _check_import_path(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _examples_when_steps(self) -> WarmupConfig:
        if self.steps and self.examples is None:
            raise ValueError(f"warmup.steps is {self.steps} but warmup.examples is not set")
        return self


class AlgorithmConfig(Section):
    loss_type: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = Field(
        "grpo",
        description="Loss variant.",
        json_schema_extra={
            "choices": {
                "grpo": "PPO-clipped token ratio; each sequence's token mean, then the mean over "
                "sequences (GRPO, DeepSeekMath, arXiv 2402.03300).",
                "dr_grpo": "Token sum / (sequences x max completion length): no length bias (Dr. GRPO, "
                "arXiv 2503.20783; pair with scale: none).",
                "dapo": "Token sum / tokens in the batch (DAPO, arXiv 2503.14476, which clips at epsilon "
                "0.2, epsilon_high 0.28).",
                "gspo": "One ratio per sequence, the geometric mean of its token ratios, clipped per "
                "sequence (GSPO, arXiv 2507.18071: epsilon 3e-4, epsilon_high 4e-4); differs from grpo "
                "only when the ratio is not 1 (num_iterations or mini_batches > 1).",
                "cispo": "The ratio, clipped to [1 - epsilon, 1 + epsilon_high] and detached, weights "
                "every token's log-probability: no token loses its gradient; token sum / tokens "
                "(CISPO, MiniMax-M1, arXiv 2506.13585, which sets no lower bound (epsilon >= 1) and "
                "tunes only the upper one; Tinker ships a cap of 4, epsilon_high 3.0).",
            }
        },
    )
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the ratio: clipped below 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip range: clipped above 1 + epsilon_high (None: epsilon)."
    )
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference model (k3); 0 = none.")
    baseline: Literal["group_mean", "leave_one_out"] = Field(
        "group_mean",
        description="What a sample's reward is compared with. Invalid samples never enter a baseline; a "
        "group with fewer than 2 valid samples trains nothing.",
        json_schema_extra={
            "choices": {
                "group_mean": "The mean of the group's valid rewards (GRPO).",
                "leave_one_out": "The mean of the other valid rewards of the group: G/(G-1) x (r - mean) "
                "(RLOO, arXiv 2402.14740, as TRL's RLOOTrainer). An optional reward's imputed value never "
                "enters another sample's baseline: each reward is left out per function. `scale` then "
                "divides as it does for group_mean; scale: none is the paper's RLOO.",
            }
        },
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage std scaling.",
        json_schema_extra={
            "choices": {
                "group": "Divide by the group's reward std (+1e-4) (GRPO).",
                "batch": "Divide by the std of every valid reward of the batch (TRL's scale_rewards batch).",
                "none": "No division (Dr. GRPO; RLOO).",
            }
        },
    )
    filter_zero_std: bool = Field(False, description="Drop groups whose valid rewards are all equal.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (Yu et al. 2025): a step keeps generating further prompts "
        "until it holds data.prompts_per_step groups whose valid rewards differ (at most "
        "max_sampling_rounds rounds, then it trains on what it has). Groups without reward variance, and "
        "those beyond prompts_per_step, land in the store with their drop reason; the data cursor "
        "stays a function of the step (further prompts come from a stream seeded by (seed, step, round)).",
    )
    max_sampling_rounds: int = Field(
        3,
        ge=1,
        le=100,
        description="With dynamic_sampling: generation rounds per step at most, the first included.",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: completions cut at the token budget are left out of the "
        "loss (their reward still counts in the group's baseline); drop reason recorded.",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Passes over each generation batch (PPO epochs; TRL's num_iterations). Old "
        "log-probabilities are taken once per batch, before its first update, so the ratio, the clip and "
        "GSPO's sequence ratio act from the second update on. Optimizer steps per batch = num_iterations "
        "x learner.mini_batches; with 1 no extra forward pass runs.",
    )
    correction: Literal["none", "tis", "icepop", "seq_mask", "seq_tis"] = Field(
        "tis",
        description="Off-policy correction of the learner's old policy against vLLM's behaviour "
        "logprobs (sampler mismatch and staleness).",
        json_schema_extra={
            "choices": {
                "none": "No correction.",
                "tis": "Each token weighted by its ratio, truncated at correction_cap (truncated "
                "importance sampling, Yao et al. 2025; TRL's token_truncate).",
                "icepop": "Tokens whose ratio lies outside [correction_low, correction_high] are dropped, "
                "the others weighted by it (IcePop, Ling team 2025).",
                "seq_mask": "A sequence is dropped when the geometric mean of its token ratios lies "
                "outside [correction_low, correction_high] (TRL's sequence_mask; SkyRL's geometric "
                "mask).",
                "seq_tis": "Every token of a sequence is weighted by the geometric mean of its token "
                "ratios, truncated at correction_cap (sequence-level truncation as TRL and SkyRL ship it, "
                "on the geometric mean so that length does not decide).",
            }
        },
    )
    correction_cap: float = Field(2.0, gt=1, description="Truncation cap of the tis and seq_tis weights.")
    correction_low: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Lower bound of the band icepop and seq_mask keep (None: 1 / correction_cap; 0: none).",
    )
    correction_high: float | None = Field(
        None, gt=1, description="Upper bound of the band icepop and seq_mask keep (None: correction_cap)."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Batches generated ahead of training; 0 = synchronous on-policy (needs "
        "sync.sync_every 1). A sample's staleness is the number of training steps between the policy "
        "that generated it and the policy trained on it; the pipeline keeps it at most max_staleness + "
        "sync.sync_every - 1, and a group staler than that (e.g. delayed by a server restart) is "
        "dropped, stored with its reason.",
    )


# The projections of a Llama/Qwen/Mistral-style decoder's attention and MLP blocks.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The adapter ranks vLLM serves (its --max-lora-rank takes one of these).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Section):
    """A LoRA adapter trained instead of the whole model (peft); the base model stays frozen."""

    rank: int = Field(16, ge=1, le=VLLM_LORA_RANKS[-1], description="Adapter rank r (vLLM serves up to 512).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training (0: the learner's logprobs are "
        "deterministic, as the importance ratio assumes).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Module names (suffixes, as peft matches them) that get an adapter; default: the "
        "attention and MLP projections. Each must name a linear layer of the model.",
    )

    def served_rank(self) -> int:
        """The smallest rank vLLM's --max-lora-rank takes that holds this adapter."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)


class LearnerConfig(Section):
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR decay.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward (grad accum).")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over a generation batch: its trained samples are split, in "
        "batch order, into this many near-equal parts (TRL's steps_per_generation). Each part's loss is "
        "normalised over that part. The LR schedule and warmup_steps count optimizer steps.",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Learner device.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None: leave torch's default)."
    )
    share_prompt: bool | None = Field(
        None,
        description="Run each group's prompt once and reuse its KV cache for the group's completions "
        "(same update, fewer FLOPs; None: on a CPU for models of 20M+ parameters, off on a GPU, where "
        "its second forward per micro-batch costs more launches than the FLOPs it saves).",
    )
    world_size: int = Field(
        1,
        ge=1,
        description="Learner processes (ranks). 1: the learner runs in the flow's process. N > 1: N Ray "
        "actors (needs scale.ray_address) in one torch.distributed group (NCCL on GPUs, gloo on CPU), "
        "the model sharded over them with FSDP2; each runs its share of a step's micro-batches and the "
        "update equals the single-process one. One GPU per rank when the Ray cluster has N GPUs.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="With world_size > 1: a collective (and the ranks' start-up) waiting longer than "
        "this fails the step instead of hanging it; a rank that dies fails it at once.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter (peft) instead of every weight: only the adapter gets gradients "
        "and optimizer state, the KL reference is the base model with the adapter disabled, and each push "
        "sends only the adapter (sync.backend 'lora'). None: full fine-tuning.",
    )


class InferenceConfig(Section):
    url: str | None = Field(None, description="vLLM server URL; None starts an embedded server.")
    urls: list[str] = Field(
        default_factory=list,
        description="Several external vLLM servers serving the same model (not with url). Each group goes "
        "to the one with the fewest outstanding groups; a weight push goes to all of them at once; one "
        "that fails leaves the rotation until it is healthy again and serves the current weights.",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Embedded servers to start when neither url nor urls is set; each gets its own share "
        "of this machine's cores and kv_cache_gb of KV cache, and is restarted and brought to the "
        "current weights if it dies.",
    )
    api_key: str | None = Field(None, description="Bearer key for the server (required off loopback).")
    host: str = Field("127.0.0.1", description="Embedded server bind address.")
    port: int | None = Field(None, ge=1, le=65535, description="Embedded server port (None: free port).")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size of the embedded CPU server (GiB).")
    max_model_len: int = Field(1024, ge=16, description="Max context length of the embedded server.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Wait this long for /health.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generation request.")
    retries: int = Field(4, ge=0, description="Retries on connection errors, timeouts and 5xx.")
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM server flags.")
    max_loras: int = Field(
        4,
        ge=1,
        description="With learner.lora: adapters one batch of an embedded server may mix (the current "
        "version, stale versions still generating, other lineages' adapters); more cost memory.",
    )

    @model_validator(mode="after")
    def _one_way_to_name_servers(self) -> InferenceConfig:
        if self.url and self.urls:
            raise ValueError("inference.urls: set inference.url (one server) or inference.urls, not both")
        if self.replicas > 1 and (self.url or self.urls):
            raise ValueError("inference.replicas: embedded replicas are started only when no url/urls is set")
        dupes = sorted({u for u in self.urls if self.urls.count(u) > 1})
        if dupes:
            raise ValueError(f"inference.urls: duplicate servers {dupes}")
        return self

    def external(self) -> list[str]:
        """The external servers to generate on: urls, or [url], or none (embedded)."""
        return list(self.urls) or ([self.url] if self.url else [])


class SyncConfig(Section):
    backend: Literal["checkpoint", "lora", "lora_merged"] | None = Field(
        None,
        description="Weight push backend (tasks/push/push.py: WeightPush): 'checkpoint' writes safetensors to "
        "the store, then vLLM reloads them (reload_weights); 'lora' writes the adapter (PEFT format) and "
        "vLLM loads it as an adapter named for the version, which requests then name; 'lora_merged' "
        "writes the adapter and each server merges it into its base weights in place (paused, as for "
        "'checkpoint'): generation at the base model's speed, but a server then serves this run's "
        "policy alone (its own servers, or an external one nothing else generates on). None: 'lora' "
        "when learner.lora is set, else 'checkpoint'. Runs, server revival, evaluation, promotion and "
        "rollback all load weights through it.",
    )
    sync_every: int = Field(
        1,
        ge=1,
        description="Push weights to vLLM every N training steps: fewer pushes, samples up to N - 1 "
        "steps staler (see algorithm.max_staleness).",
    )
    keep_last: int = Field(
        2,
        ge=1,
        description="Pushed weight versions kept on disk ('lora' also keeps, for a request timeout, "
        "adapters a server may still read, and keeps at least the last 2 loaded in each server).",
    )
    reload_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds one weight reload into vLLM may take before the push fails (the server is "
        "resumed either way). Generous: a large model from a slow disk takes minutes.",
    )


class ScaleConfig(Section):
    ray_address: str | None = Field(
        None,
        description="Ray cluster for `executor: ray` rewards and tools: None = no Ray; 'local' = start "
        "one on this machine for the run (it dies with the run); else an existing cluster's address "
        "('host:6379', or 'ray://host:10001' for Ray Client).",
    )
    object_store_mb: int = Field(
        256, ge=80, description="Object store cap of a local Ray, in MiB (Ray's minimum is about 76)."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs a local Ray offers to tasks (None: this machine's CPU count)."
    )
    startup_timeout_s: float = Field(120.0, gt=0, description="Wait this long for a local Ray to start.")


class StorageConfig(Section):
    root: str = Field("runs", description="Store root: rollouts, rewards, steps, checkpoints, weights.")
    compact_every: int = Field(
        100,
        ge=0,
        description="Compaction unit: after each checkpoint a background thread merges every full "
        "block of this many closed steps (then 10 such blocks, 100, ...) into one Parquet file per "
        "table, and the rest at the end of the run; SQL then opens a few files instead of one per "
        "step. 0: off (`grpoflow compact` still works). Keep it constant within a run.",
    )


class RunConfig(Section):
    run_id: str | None = Field(None, description="Run name (None: generated); [A-Za-z0-9._-].")
    steps: int = Field(20, ge=1, description="Training steps of this run (total, including resumed).")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept per run.")
    seed: int = Field(0, description="Seed of data order, sampling and initialisation.")
    max_failed_reward_steps: int = Field(
        2,
        ge=0,
        description="Stop the run (non-zero exit, resumable) when a required reward fails (raises, times "
        "out, returns the wrong number of values) on every completion of this many consecutive steps; "
        "each such step is logged at once. 0: never stop.",
    )
    report_to: list[Literal[TRACKER_NAMES]] = Field(
        default_factory=list,
        description="Trackers that get every step's metrics, the config, sample tables and the report's plots "
        "(settings: the `tracking` section). Each is an optional extra: pip install 'grpoflow[tracking]'. "
        "A step reaches them once a checkpoint closes it, so a resume never shows a step twice.",
    )
    log_samples_every: int = Field(
        10,
        ge=0,
        description="With run.report_to: every N steps, a table of the step's rollouts (prompt, completion, "
        "reward, each reward's status, advantage) goes to the trackers. 0: never.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Score the held-out split (data.eval_path / eval_fraction / eval_split) every N steps and "
        "after the last, on the run's servers with grpo-evaluate's seeded sampling: split='eval' rows at the "
        "step, eval/* metrics and eval_seconds in `steps`. A multiple of sync.sync_every. 0: off.",
    )
    eval_prompts: int | None = Field(
        None,
        ge=1,
        description="With run.eval_every: at most this many eval rows, in split order (None: all).",
    )
    reproducible: bool = Field(
        False,
        description="Reruns of this config with the same seed on the same machine and thread settings "
        "give bit-identical rollouts, rewards, advantages, metrics and weights, at any max_staleness and "
        "across a resume: each push first waits for the batches generated ahead (none then changes "
        "weights mid-way; the step's wait is its settle_seconds), and each checkpoint keeps those "
        "batches for a resume instead of generating them again under its weights. One server only. "
        "README, 'Reproducible runs'.",
    )
    step_task_runs: bool = Field(
        True,
        description="Show each step's rollout-batch and train-step as Prefect task runs (the UI's "
        "timeline of the pipeline). On a busy 2-core machine each costs a co-located Prefect API server "
        "~0.05 s of CPU and the run ~0.025 s: ~1.3% of a SmolLM2 step, ~18% of the tiny demo's (BENCHMARKS.md). "
        "False: the same work as plain calls; the UI keeps the flow run, its step lines, progress "
        "and tables, and checkpoints and failed writes or pushes are still task runs.",
    )

    @field_validator("run_id")
    @classmethod
    def _safe(cls, v: str | None) -> str | None:
        return None if v is None else validate_run_id(v)


def _check_import_path(v: str) -> str:
    if ":" not in v or not all(v.split(":", 1)):
        raise ValueError(f"expected an import path 'module:attribute', got {v!r}")
    return v


class TrackingConfig(Section):
    """Where the trackers of `run.report_to` write (TensorBoard needs no setting: its event files go to
    <root>/tensorboard/<run>)."""

    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI: an `mlflow server` URL (http://host:5000) or a local store. None: "
        "$MLFLOW_TRACKING_URI, else a local store under <root>/mlflow.",
    )
    mlflow_experiment: str = Field("grpoflow", min_length=1, description="MLflow experiment name.")
    wandb_project: str = Field("grpoflow", min_length=1, description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); None: W&B's default.")
    wandb_mode: Literal["offline", "online"] | None = Field(
        None,
        description="W&B mode. None: $WANDB_MODE, else offline (runs under <root>/wandb; `wandb sync` "
        "uploads them later), since many training machines have no internet.",
    )
    finish_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long the run waits at its end for trackers to take what is queued; a tracker "
        "still busy then (a server down) is left, and a resume logs what it missed.",
    )
