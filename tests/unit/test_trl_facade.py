"""grpoflow.trl without a run: TRL's GRPOConfig fields read onto the config tree, each refused field and
argument with its one-line error, the dataset forms TRL takes, and the table of TRL's fields held equal
to the installed TRL's."""

from __future__ import annotations

import dataclasses

import pytest

from grpoflow.flows.config import ConfigError, RewardConfig, ToolsConfig
from grpoflow.trl import GRPOConfig, GRPOTrainer
from grpoflow.trl.fields import GRPO_FIELDS, TRL_DEFAULTS

pytestmark = pytest.mark.unit


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


ROWS = [{"prompt": f"p{i}", "answer": i} for i in range(12)]


def _trainer(tmp_path, model_dir, **kw):
    kw.setdefault(
        "args", GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=4)
    )
    kw.setdefault("reward_funcs", reward)
    kw.setdefault("train_dataset", ROWS)
    return GRPOTrainer(model=str(model_dir), **kw)


def test_the_field_table_is_the_installed_trls():
    from transformers import TrainingArguments
    from trl import GRPOConfig as TrlConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    theirs = {}
    for f in dataclasses.fields(TrlConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        theirs[f.name] = default
    assert {k: v for k, v in theirs.items() if k not in base} == GRPO_FIELDS
    assert {k: theirs[k] for k in TRL_DEFAULTS} == TRL_DEFAULTS


def test_trl_batch_and_step_counts_become_grpoflows():
    a = GRPOConfig(
        num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
        num_iterations=2, max_steps=12, save_steps=4, warmup_steps=0.25, learning_rate=3e-6, seed=7,
    )  # fmt: skip
    o = a.overrides()
    # a generation batch: 4 x 4 = 16 completions = 4 prompts; 2 optimizer steps a pass, 2 passes
    assert (o["generation.group_size"], o["data.prompts_per_step"], o["learner.micro_batch_size"]) == (
        4,
        4,
        4,
    )
    assert (o["learner.mini_batches"], o["algorithm.num_iterations"]) == (2, 2)
    assert o["run.steps"] == 3 and o["run.checkpoint_every"] == 1  # 12 and 4 optimizer steps of 4 a batch
    assert o["learner.warmup_steps"] == 3  # a quarter of 12
    assert (o["learner.lr"], o["run.seed"], o["learner.lr_schedule"]) == (3e-6, 7, "linear")
    # TRL's defaults, where they differ from grpoflow's, are TRL's
    assert (o["algorithm.loss_type"], o["generation.max_tokens"], o["storage.root"]) == (
        "dapo",
        512,
        "trainer_output",
    )
    with pytest.raises(
        ConfigError, match=r"^GRPOConfig\.max_steps: 10 optimizer steps .*generation batches of 4"
    ):
        GRPOConfig(num_generations=4, per_device_train_batch_size=4, steps_per_generation=2, num_iterations=2,
                   max_steps=10).overrides()  # fmt: skip


def test_epochs_count_the_rows():
    a = GRPOConfig(num_generations=4, per_device_train_batch_size=8, num_train_epochs=2)
    assert a.overrides(rows=10)["run.steps"] == 10  # 2 prompts a step, 20 prompts


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"importance_sampling_level": "sequence", "loss_type": "grpo"}, {"algorithm.loss_type": "gspo"}),
        ({"scale_rewards": False}, {"algorithm.scale": "none"}),
        ({"scale_rewards": "batch"}, {"algorithm.scale": "batch"}),
        ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.5},
         {"algorithm.correction": "tis", "algorithm.correction_cap": 2.5}),
        ({"vllm_importance_sampling_correction": False}, {"algorithm.correction": "none"}),
        ({"vllm_mode": "server", "vllm_server_host": "127.0.0.1", "vllm_server_port": 9000},
         {"inference.url": "http://127.0.0.1:9000"}),
        ({"vllm_max_model_length": 2048}, {"inference.max_model_len": 2048}),
        ({"report_to": "all"}, {"run.report_to": ["tensorboard", "mlflow", "wandb"]}),
        ({"report_to": ["wandb"]}, {"run.report_to": ["wandb"]}),
        ({"bf16": True}, {"model.dtype": "bfloat16"}),
        ({"gradient_checkpointing": True}, {"learner.gradient_checkpointing": True}),
        ({"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1},
         {"generation.top_k": 20, "generation.min_p": 0.1, "generation.repetition_penalty": 1.1}),
        ({"max_tool_calling_iterations": 2}, {"generation.max_turns": 3}),
        ({"mask_truncated_completions": True}, {"algorithm.mask_truncated": True}),
        ({"save_total_limit": 3}, {"run.keep_checkpoints": 3}),
        ({"save_strategy": "no", "save_steps": 1, "max_steps": 4}, {"run.checkpoint_every": 4}),
    ],
)  # fmt: skip
def test_each_mapped_field_lands_on_its_config_field(fields, expected):
    o = GRPOConfig(**fields).overrides()
    assert {k: o[k] for k in expected} == expected


def test_fields_with_no_effect_or_at_trls_default_are_accepted():
    GRPOConfig(logging_dir="logs", push_to_hub=False, dataloader_num_workers=4, run_name="x", use_vllm=True,
               loss_type="dapo", delta=None)  # fmt: skip
    assert "learner.gradient_checkpointing" not in GRPOConfig().overrides()  # a memory choice: grpoflow's own


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_type": "bnpo"}, "GRPOConfig.loss_type: 'bnpo' cannot be honoured: grpoflow has grpo, dr_grpo"),
        ({"importance_sampling_level": "sequence", "loss_type": "dapo"}, "GRPOConfig.importance_sampling_level"),
        ({"push_to_hub": True}, "GRPOConfig.push_to_hub: True cannot be honoured: grpoflow does not upload"),
        ({"fp16": True}, "GRPOConfig.fp16: True cannot be honoured"),
        ({"optim": "sgd"}, "GRPOConfig.optim: 'sgd' cannot be honoured"),
        ({"adam_beta2": 0.99}, "GRPOConfig.adam_beta2: 0.99 cannot be honoured"),
        ({"lr_scheduler_type": "polynomial"}, "GRPOConfig.lr_scheduler_type: 'polynomial'"),
        ({"per_device_train_batch_size": 3}, "GRPOConfig.per_device_train_batch_size: 3 cannot be honoured"),
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "GRPOConfig.steps_per_generation: 3"),
        ({"top_entropy_quantile": 0.2}, "GRPOConfig.top_entropy_quantile: 0.2 cannot be honoured"),
        ({"delta": 4.0}, "GRPOConfig.delta: 4.0 cannot be honoured"),
        ({"report_to": "trackio"}, "GRPOConfig.report_to: 'trackio' cannot be honoured"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "GRPOConfig.chat_template_kwargs"),
        ({"generation_kwargs": {"seed": 1}}, "GRPOConfig.generation_kwargs"),
        ({"vllm_mode": "remote"}, "GRPOConfig.vllm_mode: 'remote'"),
        ({"vllm_importance_sampling_mode": "bad"}, "GRPOConfig.vllm_importance_sampling_mode: 'bad'"),
        ({"save_strategy": "epoch"}, "GRPOConfig.save_strategy: 'epoch'"),
        ({"eval_strategy": "epoch"}, "GRPOConfig.eval_strategy: 'epoch'"),
        ({"sync_ref_model": True}, "GRPOConfig.sync_ref_model: True cannot be honoured"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "GRPOConfig.multi_objective_aggregation"),
    ],
)  # fmt: skip
def test_a_field_grpoflow_cannot_honour_fails_at_construction_naming_it(fields, message):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**fields)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_an_unknown_field_is_a_type_error_as_in_trl():
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_generation'"):
        GRPOConfig(num_generation=4)


def test_the_trainer_builds_one_config_tree(tmp_path, tiny_model_dir):
    import pandas as pd
    from peft import LoraConfig

    a = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=4,
                   max_steps=2, reward_weights=[2.0, 0.5], grpoflow={"inference": {"url": "http://127.0.0.1:1"}, "run.checkpoint_every": 1})  # fmt: skip
    t = GRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=[reward, lambda completions, **kw: [1.0] * len(completions)],
        args=a, train_dataset=pd.DataFrame(ROWS), peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"]),
    )  # fmt: skip
    cfg = t.config("trl-unit")
    assert (cfg.rewards[0].name, cfg.rewards[0].fn, cfg.rewards[0].weight) == ("reward", reward, 2.0)
    assert cfg.rewards[1].name == "<lambda>" and cfg.rewards[1].weight == 0.5
    assert (cfg.learner.lora.rank, cfg.learner.lora.alpha, cfg.learner.lora.target_modules) == (
        8,
        16.0,
        ["q_proj"],
    )
    assert (cfg.inference.url, cfg.run.checkpoint_every, cfg.run.steps) == ("http://127.0.0.1:1", 1, 2)
    import pyarrow.parquet as pq

    assert pq.read_table(cfg.data.path).to_pylist() == ROWS  # the rows, kept in the run's store


def test_an_iterable_dataset_is_read_as_far_as_the_run_goes(tmp_path, tiny_model_dir):
    from datasets import IterableDataset

    def endless():
        i = 0
        while True:
            yield {"prompt": f"p{i}"}
            i += 1

    a = GRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8, max_steps=3
    )
    t = _trainer(tmp_path, tiny_model_dir, args=a, train_dataset=IterableDataset.from_generator(endless))
    import pyarrow.parquet as pq

    assert pq.read_metadata(t.config("trl-iter").data.path).num_rows == 6  # 3 steps x 2 prompts


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"processing_class": object()}, "processing_class: cannot be honoured: grpoflow uses the tokenizer"),
        ({"optimizers": (object(), None)}, "optimizers: cannot be honoured"),
        ({"quantization_config": object()}, "quantization_config: cannot be honoured"),
        ({"rollout_func": lambda *a: None}, "rollout_func: cannot be honoured"),
        ({"reward_funcs": None}, "reward_funcs: none given"),
        ({"reward_funcs": 3}, "reward_funcs[0]: int is neither a function nor a model directory"),
        ({"args": GRPOConfig(reward_weights=[1.0, 2.0], num_generations=4, per_device_train_batch_size=4)},
         "GRPOConfig.reward_weights: 2 weights for 1 reward_funcs"),
        ({"callbacks": [object()]}, "callbacks[0]: object is not a transformers TrainerCallback"),
    ],
)  # fmt: skip
def test_an_argument_grpoflow_cannot_honour_is_refused_naming_it(tmp_path, tiny_model_dir, kw, message):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, tiny_model_dir, **kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_loaded_model_a_hub_name_and_other_lora_options_are_refused(tmp_path, tiny_model_dir):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    with pytest.raises(
        ConfigError, match=r"^model: a loaded \w+; grpoflow loads the model itself: pass its directory"
    ):
        GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=reward)
    with pytest.raises(ConfigError, match=r"^model: 'Qwen/Qwen2.5-0.5B' is not a local model directory"):
        GRPOTrainer(model="Qwen/Qwen2.5-0.5B", reward_funcs=reward)
    with pytest.raises(ConfigError, match=r"^peft_config.use_dora: True cannot be honoured"):
        _trainer(tmp_path, tiny_model_dir, peft_config=LoraConfig(r=8, use_dora=True))

    class Evaluates(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            pass

    with pytest.raises(
        ConfigError, match=r"^callbacks\[0\]: Evaluates overrides on_evaluate, which grpoflow does not call"
    ):
        _trainer(tmp_path, tiny_model_dir, callbacks=[Evaluates()])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([{"question": "x"}], "train_dataset: row 0 has no 'prompt' column"),
        ([], "train_dataset: the dataset has no rows"),
        ({"train": ROWS, "test": ROWS}, "train_dataset: a dict of splits (train, test); pass one split"),
        (42, "train_dataset: int is not a dataset"),
    ],
)
def test_a_dataset_that_cannot_be_trained_on_is_refused_naming_the_row(
    tmp_path, tiny_model_dir, data, message
):
    t = _trainer(tmp_path, tiny_model_dir, train_dataset=data)
    with pytest.raises(ConfigError) as e:
        t.config("trl-bad")
    assert str(e.value).startswith(message)
    assert not (tmp_path / "out" / "datasets" / "trl-bad").exists()  # nothing half-written


def test_a_script_callable_is_refused_where_another_process_must_import_it():
    def closure(completions, **kw):
        return [0.0] * len(completions)

    main = type(reward)(reward.__code__, {}, "in_main")
    main.__module__ = "__main__"
    with pytest.raises(
        ValueError, match=r"reward 'c': .*closure is a lambda or a closure, and executor 'process'"
    ):
        RewardConfig(name="c", fn=closure, executor="process")
    with pytest.raises(
        ValueError,
        match=r"reward 'm': in_main is defined in __main__ \(a script or a notebook\), and executor 'ray'",
    ):
        RewardConfig(name="m", fn=main, executor="ray")
    with pytest.raises(ValueError, match=r"tools.tools\[0\]: <lambda> is a lambda"):
        ToolsConfig(tools=[lambda x: x], executor="ray")

    async def async_closure(completions, **kw):
        return [0.0] * len(completions)

    assert RewardConfig(name="t", fn=closure).fn is closure  # on a thread of this process: as TRL calls it
    # an async function runs on this process's loop whatever its executor says: nothing to send
    assert RewardConfig(name="a", fn=async_closure, executor="process").fn is async_closure
    assert RewardConfig(name="r", fn=reward, executor="process").fn is reward  # importable by its module


def test_the_example_notebook_is_a_valid_notebook_whose_code_compiles():
    import nbformat

    from tests.support import REPO

    nb = nbformat.read(REPO / "examples" / "notebooks" / "smollm2-grpo.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    for i, source in enumerate(code):
        compile(source, f"cell {i}", "exec")
    assert "from grpoflow.trl import GRPOConfig, GRPOTrainer" in code[0]


def test_a_run_refused_before_it_starts_leaves_no_rows_and_no_run(tmp_path, tiny_model_dir):
    a = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=4,
                   max_steps=1, grpoflow={"learner.lr": -1})  # fmt: skip
    t = _trainer(tmp_path, tiny_model_dir, args=a)
    with pytest.raises(ConfigError, match=r"learner\.lr"):
        t.train()  # the tree is refused after the rows were written: they go again
    assert t.run_id is None
    assert not any((tmp_path / "out" / "datasets").iterdir())


# A value away from TRL's default for each field refused with a reason of its own
REFUSED = {"push_to_hub": True, "fp16": True, "delta": 4.0, "sync_ref_model": True, "top_entropy_quantile": 0.5,
           "multi_objective_aggregation": "normalize_then_sum", "load_best_model_at_end": True,
           "generation_kwargs": {"seed": 1}, "chat_template_kwargs": {"enable_thinking": False},
           "vllm_enable_sleep_mode": True, "model_init_kwargs": {"dtype": "bfloat16"}}  # fmt: skip


def test_every_field_refused_for_a_reason_says_it():
    from grpoflow.trl.fields import REASONS

    assert set(REFUSED) == set(REASONS)
    for name, value in REFUSED.items():
        with pytest.raises(ConfigError) as e:
            GRPOConfig(**{name: value})
        assert str(e.value) == f"GRPOConfig.{name}: {value!r} cannot be honoured: {REASONS[name]}"
    with pytest.raises(
        ConfigError, match=r"^GRPOConfig.entropy_coef: 0.1 cannot be honoured: grpoflow has no equivalent"
    ):
        GRPOConfig(entropy_coef=0.1)


def test_the_store_root_follows_a_grpoflow_override_and_a_callable_object_is_not_copied(
    tmp_path, tiny_model_dir
):
    class Scorer:  # a reward with state of its own, as a callable object
        __name__ = "scorer"

        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    scorer = Scorer()
    a = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=4,
                   max_steps=1, grpoflow={"storage.root": str(tmp_path / "store")})  # fmt: skip
    t = _trainer(tmp_path, tiny_model_dir, args=a, reward_funcs=scorer)
    cfg = t.config("trl-root")
    assert t.root == cfg.storage.root == str(tmp_path / "store")
    assert cfg.data.path.startswith(str(tmp_path / "store"))  # the rows kept where the run is
    assert cfg.rewards[0].fn is scorer
