"""TRL 1.16's `GRPOConfig` fields and defaults, and how grpoflow takes those it does not map
(`args.py` maps the others onto the config tree)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

# TRL 1.16's GRPOConfig fields beyond TrainingArguments, with TRL's defaults (a unit test holds this
# table equal to the installed TRL's, where TRL is installed).
GRPO_FIELDS: dict[str, Any] = {
    "model_init_kwargs": None,
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "disable_dropout": False,
    "cast_lm_head_to_fp32": False,
    "num_generations": 8,
    "num_generations_eval": None,
    "max_completion_length": 512,
    "ds3_gather_for_generation": True,
    "shuffle_dataset": True,
    "pad_to_multiple_of": "auto",
    "generation_batch_size": None,
    "steps_per_generation": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "generation_kwargs": None,
    "chat_template_kwargs": None,
    "repetition_penalty": 1.0,
    "cache_implementation": None,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None,
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": 1,
    "beta": 0.0,
    "num_iterations": 1,
    "epsilon": 0.2,
    "delta": None,
    "epsilon_high": None,
    "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "importance_sampling_level": "token",
    "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize",
    "scale_rewards": "group",
    "loss_type": "dapo",
    "mask_truncated_completions": False,
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005,
    "entropy_target": 0.2,
    "max_tool_calling_iterations": None,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": True,
    "log_completions": False,
    "log_multimodal": True,
    "num_completions_to_print": None,
    "log_unique_prompts": False,
    "log_completions_hub_repo": None,
    "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None,
    "use_transformers_paged": False,
    "vllm_importance_sampling_cap": None,
}

# Where TRL's GRPOConfig changes TrainingArguments' defaults.
TRL_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-6,
    "bf16": None,
    "gradient_checkpointing": True,
    "logging_steps": 10,
    "remove_unused_columns": False,
}


def names(words: str) -> frozenset[str]:
    return frozenset(words.split())


# Fields that change nothing grpoflow does (logging, hub, dataloader and distributed plumbing, what
# TRL's own generation path or its trackers read): accepted with any value.
NO_EFFECT = names(
    "logging_dir logging_strategy logging_first_step logging_nan_inf_filter log_on_each_node log_level "
    "log_level_replica run_name project trackio_space_id trackio_bucket_id trackio_static_space_id "
    "include_num_input_tokens_seen skip_memory_metrics hub_token hub_private_repo hub_model_id hub_strategy "
    "hub_revision hub_always_push dataloader_drop_last dataloader_num_workers dataloader_pin_memory "
    "dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context "
    "dataloader_in_order remove_unused_columns label_names length_column_name train_sampling_strategy "
    "ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend "
    "ddp_timeout local_rank debug do_train do_eval do_predict overwrite_output_dir save_safetensors "
    "save_only_model save_on_each_node per_device_eval_batch_size eval_accumulation_steps eval_delay "
    "eval_do_concat_batches eval_use_gather_object prediction_loss_only include_for_metrics "
    "batch_eval_metrics torch_empty_cache_steps tf32 use_cache average_tokens_across_devices "
    "ds3_gather_for_generation pad_to_multiple_of cache_implementation vllm_model_impl "
    "vllm_server_timeout vllm_group_port log_completions log_multimodal num_completions_to_print "
    "log_unique_prompts use_vllm disable_tqdm trust_remote_code full_determinism data_seed "
    "resume_from_checkpoint ignore_data_skip restore_callback_states_from_checkpoint "
    "use_transformers_paged logging_dir "
    # TRL multiplies its KL term by the policy ratio by default; grpoflow never does (False is its KL):
    # the field is taken either way, and docs/from-trl.md says so
    "use_bias_correction_kl"
)

# Why a field set away from TRL's default is refused, where more can be said than "no equivalent".
REASONS: dict[str, str] = {
    "push_to_hub": "grpoflow does not upload; export with trainer.save_model(dir) and push that",
    "fp16": "grpoflow computes in bfloat16 (bf16=True) or float32, never float16",
    "delta": "grpoflow has no two-sided clip (INTELLECT-2's delta)",
    "sync_ref_model": "the reference stays the starting model",
    "top_entropy_quantile": "grpoflow trains on every token of a completion",
    "multi_objective_aggregation": "grpoflow sums the weighted rewards, then normalises",
    "load_best_model_at_end": "grpoflow keeps every checkpoint's step; export the one you choose",
    "generation_kwargs": "only temperature, top_p, top_k, min_p and repetition_penalty reach vLLM",
    "chat_template_kwargs": "grpoflow renders prompts with the model's chat template as it is "
    "(model.chat_template replaces it: GRPOConfig(grpoflow={'model.chat_template': ...}))",
    "vllm_enable_sleep_mode": "grpoflow's vLLM server runs beside the learner, never asleep",
    "model_init_kwargs": "grpoflow loads the model directory itself (bf16= sets its compute dtype)",
}


@functools.cache
def trl_fields() -> dict[str, Any]:
    """Every field of TRL's GRPOConfig -> TRL's default."""
    import transformers

    base: dict[str, Any] = {}
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.default is not dataclasses.MISSING:
            base[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            base[f.name] = f.default_factory()
        else:
            base[f.name] = None
    return base | TRL_DEFAULTS | GRPO_FIELDS
