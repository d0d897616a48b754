"""`GRPOConfig` by TRL 1.16's field names, read onto grpoflow's config tree (docs/from-trl.md's table).

Every field of TRL's `GRPOConfig` is accepted by name, with TRL's default: transformers' own
`TrainingArguments` fields (read from the installed transformers, as TRL inherits them) and the GRPO
fields below. A field grpoflow reads maps onto the tree (`overrides`); a field left at TRL's default is
never an error; a field set to a value grpoflow cannot honour fails at construction, naming the field and
why; a field with no effect on a run (`NO_EFFECT`) is accepted as it is; an unknown name is a TypeError.
"""

from __future__ import annotations

import math
from typing import Any

from grpoflow.flows.config import ConfigError
from grpoflow.trl.fields import NO_EFFECT, REASONS, names, trl_fields

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo")
SCALES = {"group": "group", True: "group", "batch": "batch", "none": "none", False: "none"}
CORRECTIONS = {
    "token_truncate": "tis",
    "token_mask": "icepop",
    "sequence_truncate": "seq_tis",
    "sequence_mask": "seq_mask",
}
SCHEDULES = ("constant", "linear", "cosine")
TRACKERS = ("tensorboard", "mlflow", "wandb")


class GRPOConfig:
    """TRL's `GRPOConfig`, read by grpoflow. Beside TRL's fields, `grpoflow={...}` sets grpoflow's own
    config tree by dotted keys as `--set` takes them (`{"inference.url": "http://127.0.0.1:8000"}`),
    applied after the TRL fields."""

    def __init__(
        self, output_dir: str | None = None, *, grpoflow: dict[str, Any] | None = None, **fields: Any
    ):
        known = trl_fields()
        for name in fields:
            if name not in known and name not in NO_EFFECT and name != "warmup_ratio":
                raise TypeError(f"GRPOConfig.__init__() got an unexpected keyword argument {name!r}")
        if output_dir is not None:
            fields["output_dir"] = output_dir
        self._given = dict(fields)
        for name, default in known.items():
            setattr(self, name, fields.get(name, default))
        for name in fields.keys() - known.keys():  # fields of older transformers: logging_dir, warmup_ratio
            setattr(self, name, fields[name])
        self.grpoflow = dict(grpoflow or {})
        self.overrides()  # a field grpoflow cannot honour fails here, at construction
        self.eval_every(1)

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def changed(self, name: str) -> bool:
        """Whether `name` differs from TRL's default (set, and to another value)."""
        return name in self._given and self._given[name] != trl_fields().get(name)

    def overrides(self, rows: int | None = None) -> dict[str, Any]:
        """The config tree's dotted keys this config sets; `rows` (the training rows, when known)
        turns `num_train_epochs` into `run.steps` when `max_steps` is not set."""
        self._refuse_the_unmapped()
        out: dict[str, Any] = {}
        for part in (_batch, _generation, _algorithm, _correction, _optimizer, _run, _server):
            out.update(part(self))
        per_batch = self.num_iterations * out["learner.mini_batches"]  # optimizer steps per generation batch
        out["run.steps"] = steps = self.train_steps(per_batch, out["data.prompts_per_step"], rows)
        # TRL counts save_steps and warmup_steps in optimizer steps (below 1: a ratio of the run)
        saves = (
            _in_steps(self.save_steps, steps * per_batch) if _strategy(self.save_strategy) == "steps" else 0
        )
        # save_strategy 'no': the run's last step only (a run always ends with a checkpoint)
        out["run.checkpoint_every"] = max(1, math.ceil(saves / per_batch)) if saves else steps
        ratio = getattr(self, "warmup_ratio", 0) or 0  # a field of transformers before 5 only
        warmup = _in_steps(self.warmup_steps, steps * per_batch) or ratio * steps * per_batch
        out["learner.warmup_steps"] = math.ceil(warmup)
        return out

    def train_steps(self, per_batch: int, prompts_per_step: int, rows: int | None) -> int:
        """grpoflow's `run.steps` (generation batches): TRL's `max_steps` counts optimizer steps."""
        if self.max_steps > 0:
            if self.max_steps % per_batch:
                raise ConfigError(
                    f"GRPOConfig.max_steps: {self.max_steps} optimizer steps is not a whole number of "
                    f"generation batches of {per_batch} (num_iterations x steps_per_generation / "
                    "gradient_accumulation_steps)"
                )
            return self.max_steps // per_batch
        if rows is None:
            return 1  # checked again with the dataset's length by the trainer
        return max(1, math.ceil(self.num_train_epochs * rows / prompts_per_step))

    def logging_every(self, optimizer_steps: int) -> int:
        """TRL's `logging_steps` in optimizer steps."""
        return max(1, math.ceil(_in_steps(self.logging_steps, optimizer_steps)))

    def eval_every(self, optimizer_steps: int) -> int | None:
        """TRL's eval cadence in optimizer steps: None with eval_strategy 'no'."""
        strategy = _strategy(self.eval_strategy)
        if strategy == "no":
            return None
        if strategy != "steps":
            raise _fail(
                "eval_strategy", strategy, "grpoflow evaluates every eval_steps steps ('steps' or 'no')"
            )
        every = self.eval_steps if self.eval_steps is not None else self.logging_steps
        return max(1, math.ceil(_in_steps(every, optimizer_steps)))

    def _refuse_the_unmapped(self) -> None:
        for name in self._given:
            if name in MAPPED or name in NO_EFFECT or not self.changed(name):
                continue
            why = REASONS.get(name, "grpoflow has no equivalent (docs/from-trl.md)")
            raise ConfigError(f"GRPOConfig.{name}: {self._given[name]!r} cannot be honoured: {why}")


def _strategy(value: Any) -> str:
    """A transformers strategy (an enum, or its string)."""
    return str(getattr(value, "value", value))


def _fail(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"GRPOConfig.{field}: {value!r} cannot be honoured: {why}")


def _batch(a: GRPOConfig) -> dict[str, Any]:
    g = a.num_generations
    steps_per_gen = a.steps_per_generation or a.gradient_accumulation_steps
    if a.generation_batch_size is not None:
        if a.generation_batch_size % (a.per_device_train_batch_size) or a.steps_per_generation:
            raise _fail(
                "generation_batch_size",
                a.generation_batch_size,
                "set it or steps_per_generation, a multiple of per_device_train_batch_size",
            )
        steps_per_gen = a.generation_batch_size // a.per_device_train_batch_size
    if steps_per_gen % a.gradient_accumulation_steps:
        raise _fail(
            "steps_per_generation", steps_per_gen, "it must be a multiple of gradient_accumulation_steps"
        )
    batch = a.per_device_train_batch_size * steps_per_gen  # completions per generation batch
    if batch % g:
        raise _fail(
            "per_device_train_batch_size",
            a.per_device_train_batch_size,
            f"a generation batch of {batch} completions is not a whole number of groups of num_generations "
            f"{g} (per_device_train_batch_size x steps_per_generation must be a multiple of it)",
        )
    return {
        "generation.group_size": g,
        "data.prompts_per_step": batch // g,
        "learner.micro_batch_size": a.per_device_train_batch_size,
        "learner.mini_batches": steps_per_gen // a.gradient_accumulation_steps,
        "data.shuffle": a.shuffle_dataset,
    }


def _generation(a: GRPOConfig) -> dict[str, Any]:
    out = {
        "generation.max_tokens": a.max_completion_length,
        "generation.temperature": a.temperature,
        "generation.top_p": a.top_p,
        "generation.top_k": max(a.top_k or 0, 0),
        "generation.min_p": a.min_p or 0.0,
        "generation.repetition_penalty": a.repetition_penalty,
    }
    if a.max_tool_calling_iterations is not None:  # N tool rounds: N + 1 model turns
        out["generation.max_turns"] = a.max_tool_calling_iterations + 1
    return out


def _algorithm(a: GRPOConfig) -> dict[str, Any]:
    loss = a.loss_type
    if a.importance_sampling_level == "sequence":
        if loss != "grpo":
            raise _fail(
                "importance_sampling_level",
                "sequence",
                f"a sequence-level ratio is grpoflow's gspo, which is loss_type 'grpo'; got {loss!r}",
            )
        loss = "gspo"
    elif a.importance_sampling_level != "token":
        raise _fail("importance_sampling_level", a.importance_sampling_level, "'token' or 'sequence'")
    elif loss not in LOSS_TYPES:
        raise _fail(
            "loss_type",
            loss,
            f"grpoflow has {', '.join(LOSS_TYPES)} (and gspo: importance_sampling_level='sequence')",
        )
    if a.scale_rewards not in SCALES:
        raise _fail("scale_rewards", a.scale_rewards, "'group', 'batch' or 'none'")
    out = {
        "algorithm.loss_type": loss,
        "algorithm.beta": a.beta,
        "algorithm.epsilon": a.epsilon,
        "algorithm.epsilon_high": a.epsilon_high,
        "algorithm.scale": SCALES[a.scale_rewards],
        "algorithm.num_iterations": a.num_iterations,
        "algorithm.mask_truncated": a.mask_truncated_completions,
    }
    return out


def _correction(a: GRPOConfig) -> dict[str, Any]:
    """vLLM importance-sampling correction: only when the script sets it (grpoflow's own default
    otherwise; TRL's sequence ratio is a product where grpoflow's is a geometric mean, so TRL's default
    thresholds do not carry over)."""
    names = (
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap",
    )
    if not any(n in a._given for n in names):
        return {}
    if not a.vllm_importance_sampling_correction:
        return {"algorithm.correction": "none"}
    mode = a.vllm_importance_sampling_mode
    if mode not in CORRECTIONS:
        raise _fail("vllm_importance_sampling_mode", mode, f"one of {', '.join(CORRECTIONS)}")
    out: dict[str, Any] = {"algorithm.correction": CORRECTIONS[mode]}
    cap = a.vllm_importance_sampling_cap or a.vllm_importance_sampling_clip_max
    if CORRECTIONS[mode] in ("tis", "seq_tis"):
        out["algorithm.correction_cap"] = cap
    else:
        out["algorithm.correction_high"] = cap
        out["algorithm.correction_low"] = a.vllm_importance_sampling_clip_min or 0.0
    return out


def _optimizer(a: GRPOConfig) -> dict[str, Any]:
    if not str(a.optim).startswith("adamw_torch"):
        raise _fail(
            "optim", a.optim, "grpoflow's optimizer is torch's AdamW (adamw_torch, adamw_torch_fused)"
        )
    for name in ("adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_kwargs", "optim_args"):
        if a.changed(name):
            raise _fail(name, getattr(a, name), "grpoflow's AdamW keeps torch's betas and epsilon")
    schedule = str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type))
    if schedule not in SCHEDULES:
        raise _fail("lr_scheduler_type", schedule, f"grpoflow schedules {', '.join(SCHEDULES)}")
    if a.fp16:
        raise _fail("fp16", True, REASONS["fp16"])
    out: dict[str, Any] = {
        "learner.lr": a.learning_rate,
        "learner.lr_schedule": schedule,
        "learner.weight_decay": a.weight_decay,
        "learner.max_grad_norm": a.max_grad_norm,
        "model.dtype": {True: "bfloat16", False: "float32", None: "auto"}[a.bf16],
    }
    if "gradient_checkpointing" in a._given:  # a memory choice: grpoflow's own default unless asked
        out["learner.gradient_checkpointing"] = a.gradient_checkpointing
    if a.torch_compile:
        out["learner.compile"] = True
    if a.use_cpu:
        out["learner.device"] = "cpu"
    return out


def _run(a: GRPOConfig) -> dict[str, Any]:
    report = [a.report_to] if isinstance(a.report_to, str) else list(a.report_to or [])
    report = TRACKERS if report == ["all"] else [r for r in report if r != "none"]
    unknown = [r for r in report if r not in TRACKERS]
    if unknown:
        raise _fail("report_to", unknown[0], f"grpoflow reports to {', '.join(TRACKERS)}")
    if _strategy(a.save_strategy) not in ("steps", "no"):
        raise _fail("save_strategy", a.save_strategy, "grpoflow checkpoints every save_steps steps")
    out: dict[str, Any] = {
        "storage.root": a.output_dir or "trainer_output",
        "run.seed": a.seed,
        "run.report_to": list(report),
    }
    if a.save_total_limit:
        out["run.keep_checkpoints"] = a.save_total_limit
    return out


def _in_steps(value: float, total: int) -> float:
    """A TRL step count, where a value below 1 is a ratio of the run's `total` steps."""
    return value * total if 0 < value < 1 else value


def _server(a: GRPOConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if a.vllm_mode == "server" or a.vllm_server_base_url:
        out["inference.url"] = a.vllm_server_base_url or f"http://{a.vllm_server_host}:{a.vllm_server_port}"
    elif a.vllm_mode != "colocate":
        raise _fail("vllm_mode", a.vllm_mode, "'colocate' (grpoflow's embedded server) or 'server'")
    if a.vllm_max_model_length:
        out["inference.max_model_len"] = a.vllm_max_model_length
    extra = []
    if a.changed("vllm_gpu_memory_utilization"):
        extra += ["--gpu-memory-utilization", str(a.vllm_gpu_memory_utilization)]
    if a.changed("vllm_tensor_parallel_size"):
        extra += ["--tensor-parallel-size", str(a.vllm_tensor_parallel_size)]
    if extra:
        out["inference.extra_args"] = extra
    return out


# Every field the parts above read: these are never refused for being set, only for their value.
MAPPED = names(
    "num_generations per_device_train_batch_size gradient_accumulation_steps generation_batch_size "
    "steps_per_generation shuffle_dataset max_completion_length temperature top_p top_k min_p "
    "repetition_penalty max_tool_calling_iterations loss_type importance_sampling_level beta epsilon "
    "epsilon_high scale_rewards num_iterations mask_truncated_completions vllm_importance_sampling_correction "
    "vllm_importance_sampling_mode vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min "
    "vllm_importance_sampling_cap optim adam_beta1 adam_beta2 adam_epsilon lr_scheduler_type learning_rate "
    "weight_decay max_grad_norm warmup_steps warmup_ratio bf16 fp16 gradient_checkpointing torch_compile "
    "use_cpu report_to save_strategy output_dir seed save_steps save_total_limit max_steps num_train_epochs "
    "vllm_mode vllm_server_base_url vllm_server_host vllm_server_port vllm_max_model_length "
    "vllm_gpu_memory_utilization vllm_tensor_parallel_size logging_steps eval_strategy eval_steps "
    "reward_weights"
)
