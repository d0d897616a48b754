"""`GRPOTrainer` with TRL 1.16's constructor: its arguments become one grpoflow config tree, and `train()`
runs the `grpo-train` flow with it (the module doc of grpoflow.trl)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from grpoflow.flows.config import ConfigError, set_dotted, validate_config
from grpoflow.flows.config import GRPOConfig as Tree
from grpoflow.flows.training.runs import new_run_id
from grpoflow.flows.training.step_close import step_listeners
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import validate_run_id
from grpoflow.trl.args import GRPOConfig
from grpoflow.trl.callbacks import Callbacks, StepLog, check_callbacks
from grpoflow.trl.data import dataset_file, keep_rows, rows_of
from grpoflow.trl.session import checkpointed, no_running_loop, progress, quiet, start_explorer

# peft LoraConfig fields grpoflow's adapter has (r, alpha, dropout, targets) or that change nothing;
# any other set away from peft's default is refused.
LORA_READ = {
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "task_type",
    "inference_mode",
    "base_model_name_or_path",
    "revision",
    "peft_type",
    "auto_mapping",
}


class GRPOTrainer:
    """TRL's `GRPOTrainer`, running on grpoflow: `train()` is a `grpo-train` flow run."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Any] | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ):
        self.model_dir = _model_dir(model)
        self.args = args if args is not None else GRPOConfig(output_dir=f"{Path(self.model_dir).name}-GRPO")
        if not isinstance(self.args, GRPOConfig):
            raise ConfigError("args: pass grpoflow.trl.GRPOConfig (TRL's own GRPOConfig is TRL's trainer's)")
        _refuse(
            processing_class is not None and not _same_dir(processing_class, self.model_dir),
            "processing_class",
            "grpoflow uses the tokenizer saved in the model directory; save yours there (tokenizer.save_pretrained)",
        )
        _refuse(
            any(o is not None for o in optimizers),
            "optimizers",
            "grpoflow's optimizer is AdamW, set by GRPOConfig's fields",
        )
        _refuse(quantization_config is not None, "quantization_config", "grpoflow trains unquantized weights")
        _refuse(
            rollout_func is not None,
            "rollout_func",
            "grpoflow's rollout loop generates; give tools= or environment_factory= instead",
        )
        self.rewards = _rewards(reward_funcs, reward_processing_classes, self.args, environment_factory)
        self.lora = _lora(peft_config)
        self.tools, self.environment = list(tools or []), environment_factory
        self.callbacks = check_callbacks(callbacks)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.run_id: str | None = None
        from transformers import TrainerState

        self.state = TrainerState()
        self._explorer: str | None = None

    # -- the config tree ------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """The store's root: `output_dir`, or `grpoflow={"storage.root": ...}` over it, as the run's tree."""
        return _flat(self.args.grpoflow).get("storage.root", self.args.overrides()["storage.root"])

    def config(self, run_id: str, resume: bool = False) -> Tree:
        """The run's grpoflow config: TRL's fields, the script's callables, its data in the store."""
        a, raw = self.args, {}
        train_rows = None
        if self.train_dataset is not None:
            path = dataset_file(self.root, run_id, "train")
            if not (resume and path.exists()):  # a resumed run trains on the rows its first launch kept
                rows = rows_of(self.train_dataset, "train_dataset", limit=self._iterable_limit())
                keep_rows(rows, path, "train_dataset")
                train_rows = len(rows)
            set_dotted(raw, "data.path", str(path))
        elif self.environment is None:
            raise ConfigError(
                "train_dataset: none given (only an environment_factory's reset() can give the prompts)"
            )
        else:
            set_dotted(raw, "data.generator", None)
        train_rows = train_rows or self._stored_rows(run_id)
        for key, value in a.overrides(train_rows).items():
            set_dotted(raw, key, value)
        if self.eval_dataset is not None:
            path = dataset_file(self.root, run_id, "eval")
            if not path.exists():
                keep_rows(rows_of(self.eval_dataset, "eval_dataset"), path, "eval_dataset")
            set_dotted(raw, "data.eval_path", str(path))
            per_batch = raw["algorithm"]["num_iterations"] * raw["learner"]["mini_batches"]
            every = a.eval_every(raw["run"]["steps"] * per_batch)
            if every is not None:
                set_dotted(raw, "run.eval_every", max(1, every // per_batch))
        set_dotted(raw, "model.path", self.model_dir)
        set_dotted(raw, "run.run_id", run_id)
        set_dotted(raw, "rewards", self.rewards)
        set_dotted(raw, "tools.tools", self.tools)
        if self.environment is not None:
            set_dotted(raw, "tools.environment", self.environment)
        if self.lora is not None:
            set_dotted(raw, "learner.lora", self.lora)
        for key, value in _flat(a.grpoflow).items():
            set_dotted(raw, key, value)
        return validate_config(raw)  # not load_config(base=): a deep copy would copy a callable object

    def _iterable_limit(self) -> int | None:
        o = self.args.overrides()
        return o["run.steps"] * o["data.prompts_per_step"] if self.args.max_steps > 0 else None

    def _stored_rows(self, run_id: str) -> int | None:
        import pyarrow.parquet as pq

        path = dataset_file(self.root, run_id, "train")
        return pq.ParquetFile(path).metadata.num_rows if path.exists() else None

    # -- running ----------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """Run the `grpo-train` flow: a new run, or `resume_from_checkpoint` (True: this trainer's last
        run, else the store's latest; a run id; or a checkpoint folder of the store) continued."""
        from transformers import TrainerState
        from transformers.trainer_utils import TrainOutput

        from grpoflow.flows.training.train import grpo_train

        if kwargs:
            raise TypeError(f"train() got an unexpected keyword argument {next(iter(kwargs))!r}")
        resume = self._resume(resume_from_checkpoint)
        run_id = resume or new_run_id()
        try:
            cfg = self.config(run_id, resume=resume is not None)
            per_batch = cfg.algorithm.num_iterations * cfg.learner.mini_batches
            log = StepLog(self.root, run_id, per_batch, self._stored_rows(run_id), cfg.data.prompts_per_step)
            self.state = TrainerState(
                max_steps=cfg.run.steps * per_batch, logging_steps=self.args.logging_steps
            )
            every = self.args.logging_every(cfg.run.steps * per_batch)
            with progress(self.args, cfg.run.steps, run_id, checkpointed(self.root, resume)) as bar:
                listener = Callbacks(self.args, self.state, self.callbacks, log, every, bar)
                with step_listeners(run_id, listener), quiet(bar is not None), no_running_loop():
                    summary = grpo_train(config=cfg, resume=resume)
        finally:
            self._settle(run_id, resume)
        self._fill_state(cfg, log, every)
        listener.end()
        loss = [e["loss"] for e in self.state.log_history if "loss" in e]
        return TrainOutput(self.state.global_step, sum(loss) / len(loss) if loss else 0.0, summary)

    def _settle(self, run_id: str, resume: str | None) -> None:
        """After train(), however it ended: a run the store has is this trainer's (a resume continues
        it); a new run that never started (refused before the flow wrote its record) leaves no rows."""
        if RolloutStore(self.root).read_run_meta(run_id) is not None:
            self.run_id = run_id
        elif resume is None:
            shutil.rmtree(dataset_file(self.root, run_id, "train").parent, ignore_errors=True)

    def _resume(self, resume: str | bool | None) -> str | None:
        if not resume:
            return None
        store = RolloutStore(self.root)
        if resume is True:
            if self.run_id is not None:
                return self.run_id
            runs = sorted(store.runs(), key=lambda r: (store.read_run_meta(r) or {}).get("created_at", ""))
            if not runs:
                raise ConfigError(f"resume_from_checkpoint: no run under {self.root} to resume")
            return runs[-1]
        p = Path(str(resume))
        if p.parts and "checkpoints" in p.parts[:-1]:  # <root>/checkpoints/<run>/step-N
            return validate_run_id(p.parts[p.parts.index("checkpoints") + 1])
        return validate_run_id(str(resume))

    def _fill_state(self, cfg: Tree, log: StepLog, every: int) -> None:
        """`state.log_history` from the run's `steps` table, TRL's logged steps only (all of the run's,
        those before a resume too)."""
        rows = sorted(RolloutStore(self.root).read_steps(self.run_id), key=lambda r: r["step"])
        entries = log.entries(rows)
        self.state.log_history = [e for e in entries if e["step"] % every == 0]
        self.state.global_step = entries[-1]["step"] if entries else 0
        self.state.epoch = entries[-1].get("epoch") if entries else None

    # -- after a run ------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> Path:
        """Export the run's latest checkpoint as `grpoflow export` does (the model, or its adapter)."""
        from grpoflow.flows.lineage.export import export_checkpoint

        run_id = self._ran("save_model")
        out = Path(output_dir) if output_dir is not None else Path(self.root) / "exports" / run_id
        return export_checkpoint(self.root, run_id, out).out

    def sql(self, sql: str) -> Any:
        """A read-only query over the store (every run in it), as a pandas DataFrame."""
        from grpoflow.storage.sql import query_arrow

        return query_arrow(self.root, sql).to_pandas()

    def explore(self, port: int = 0) -> str:
        """Start the rollout explorer over the store (on loopback, in this process) and return the run's
        page."""
        run_id = self._ran("explore")
        if self._explorer is None:
            self._explorer = start_explorer(self.root, port)
        return f"{self._explorer}#/run/{run_id}"

    def _ran(self, what: str) -> str:
        if self.run_id is None:
            raise RuntimeError(f"{what}(): no run yet; call train() first")
        return self.run_id


def _refuse(cond: bool, field: str, why: str) -> None:
    if cond:
        raise ConfigError(f"{field}: cannot be honoured: {why}")


def _model_dir(model: Any) -> str:
    if hasattr(model, "save_pretrained"):
        raise ConfigError(
            f"model: a loaded {type(model).__name__}; grpoflow loads the model itself: pass its directory "
            "(model.save_pretrained(dir), then model=dir)"
        )
    path = Path(os.fspath(model))
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model: {str(model)!r} is not a local model directory (with config.json); grpoflow reads models "
            "from disk: download it first (hf download NAME --local-dir DIR)"
        )
    return str(path.resolve())


def _same_dir(tokenizer: Any, model_dir: str) -> bool:
    name = getattr(tokenizer, "name_or_path", None)
    return bool(name) and Path(name).resolve() == Path(model_dir)


def _rewards(funcs: Any, processing: Any, args: GRPOConfig, environment: Any) -> list[dict[str, Any]]:
    funcs = funcs if isinstance(funcs, list | tuple) else ([] if funcs is None else [funcs])
    if not funcs and environment is None:
        raise ConfigError(
            "reward_funcs: none given (a function, a list of them, or a reward model's directory)"
        )
    processing = processing if isinstance(processing, list | tuple) else [processing] * len(funcs)
    weights = args.reward_weights
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(f"GRPOConfig.reward_weights: {len(weights)} weights for {len(funcs)} reward_funcs")
    out = []
    for i, f in enumerate(funcs):
        weight = {"weight": float(weights[i])} if weights is not None else {}
        if isinstance(f, str | os.PathLike):
            if processing[i] is not None and not _same_dir(processing[i], str(Path(f).resolve())):
                raise ConfigError(
                    f"reward_processing_classes[{i}]: grpoflow uses the tokenizer saved with the reward model "
                    f"{f!s}; save yours there"
                )
            out.append({"name": Path(f).name, "model": str(Path(f).resolve()), **weight})
        elif callable(f):
            if hasattr(f, "save_pretrained"):
                raise ConfigError(f"reward_funcs[{i}]: a loaded model; pass its directory instead")
            # TRL's form: a conversational prompt's completions as messages, a plain-text one's as text
            name = getattr(f, "__name__", type(f).__name__)
            out.append({"name": name, "fn": f, "completions": "messages", **weight})
        else:
            raise ConfigError(
                f"reward_funcs[{i}]: {type(f).__name__} is neither a function nor a model directory"
            )
    return out


def _lora(peft_config: Any) -> dict[str, Any] | None:
    if peft_config is None:
        return None
    import dataclasses

    if not dataclasses.is_dataclass(peft_config) or not hasattr(peft_config, "lora_alpha"):
        raise ConfigError(f"peft_config: {type(peft_config).__name__} is not peft's LoraConfig")
    fresh = type(peft_config)()  # peft's defaults, as its __post_init__ leaves them
    for f in dataclasses.fields(peft_config):
        if f.name not in LORA_READ and getattr(peft_config, f.name) != getattr(fresh, f.name):
            raise ConfigError(
                f"peft_config.{f.name}: {getattr(peft_config, f.name)!r} cannot be honoured: grpoflow's adapters "
                "take r, lora_alpha, lora_dropout and target_modules"
            )
    out: dict[str, Any] = {
        "rank": peft_config.r,
        "alpha": peft_config.lora_alpha,
        "dropout": peft_config.lora_dropout,
    }
    targets = peft_config.target_modules
    if targets is not None:
        out["target_modules"] = [targets] if isinstance(targets, str) else sorted(targets)
    return out


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` and `{"a.b": 1}` alike -> `{"a.b": 1}` (a section given whole merges key by key)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out.update(
            _flat(v, key + ".") if isinstance(v, dict) and v and key != "tools.environment" else {key: v}
        )
    return out
