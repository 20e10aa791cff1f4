"""Flat TRL/Unsloth `GRPOConfig` names -> Tandem job sections.

Known names map onto our fields; names that would change training and that we do not
support are one error listing them all (unless set to their neutral value); cosmetic names
(logging, hub, reporting) are ignored with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

# TRL name -> (section, field). Same leaf name unless stated.
_SECTION_OF = {
    "generation": ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_prompt_length",
                   "max_completion_length", "max_tool_calling_iterations"],
    "batch": ["per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
              "num_generations", "max_steps", "num_train_epochs"],
    "grpo": ["beta", "num_iterations", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
             "reward_weights", "scale_rewards", "loss_type", "mask_truncated_completions",
             "vllm_importance_sampling_correction", "vllm_importance_sampling_cap",
             "vllm_importance_sampling_mode"],
    "optimizer": ["learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "warmup_ratio",
                  "warmup_steps", "lr_scheduler_type", "max_grad_norm"],
    "checkpoint": ["save_steps", "save_total_limit"],
    "logging": ["output_dir", "overwrite_output_dir", "report_to", "run_name"],
}
KNOWN: dict[str, tuple[str, str]] = {name: (sec, name) for sec, names in _SECTION_OF.items() for name in names}
KNOWN.update({
    "train_batch_size": ("batch", "per_device_train_batch_size"),  # the seed's name
    "use_vllm": ("model", "fast_inference"),
    "gradient_checkpointing": ("model", "gradient_checkpointing"),
    "use_liger_kernel": ("model", "use_liger_kernel"),  # TRL's false kept; true: Liger's layers (or refused)
    "seed": ("", "seed"),
    "vllm_gpu_memory_utilization": ("cluster", "vllm_gpu_memory_utilization"),
    "vllm_importance_sampling_clip_max": ("grpo", "vllm_importance_sampling_cap"),  # TRL's name for the cap
    "vllm_importance_sampling_clip_min": ("grpo", "vllm_importance_sampling_clip_min"),
    "off_policy_mask_threshold": ("grpo", "off_policy_mask_threshold"),
})

# Names that change training; accepted at TRL 1.16's default (what `trl.GRPOConfig()` prints: the
# value under which Tandem computes what TRL computes), refused otherwise.
UNSUPPORTED_NEUTRAL: dict[str, Any] = {
    "top_entropy_quantile": 1.0, "sync_ref_model": False, "use_liger_loss": False,
    "liger_kernel_config": None, "cast_lm_head_to_fp32": False, "generation_kwargs": None,
    "label_smoothing_factor": 0.0, "disable_dropout": False, "shuffle_dataset": True, "mask_truncated": None,
    "vllm_importance_sampling_min": None, "num_processes": 1, "gradient_accumulation": None,
    "lr_scheduler_kwargs": None, "max_grad_value": None, "tf32": None, "optim_args": None,
    "average_tokens_across_devices": True, "neftune_noise_alpha": None, "auto_find_batch_size": False,
    "full_determinism": False, "data_seed": None, "vllm_max_model_length": None, "model_init_kwargs": None,
    "router_aux_loss_coef": None, "chat_template_kwargs": None, "pad_to_multiple_of": None,
    "vllm_structured_outputs_regex": None, "sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
    "multi_objective_aggregation": "sum_then_normalize", "entropy_coef": 0.0, "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "train_sampling_strategy": "random", "resume_from_checkpoint": None,
    "fsdp": None, "fsdp_config": None, "deepspeed": None, "parallelism_config": None, "trust_remote_code": False,
    "dataloader_drop_last": False, "ignore_data_skip": False, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False,
    "cache_implementation": None, "torch_compile_backend": None, "torch_compile_mode": None,
}
# Only matter with a reference model (beta > 0): accepted at any value when beta is 0.
REFERENCE_ONLY = {"use_bias_correction_kl": False, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512}

# TRL 1.16's defaults where Tandem's own (docs/grpo.md) differ: a TRL dict that leaves one out means TRL's.
TRL_DEFAULTS: dict[str, Any] = {
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "max_completion_length": 512, "gradient_checkpointing": True, "save_steps": 500,
}

# Names with no effect on what is trained, each group with why (warned once when set)
IGNORED: dict[str, tuple[str, ...]] = {
    "logging and reporting: every step goes to <output_dir>/metrics.jsonl and logging.report_to's trackers": (
        "logging_steps", "logging_dir", "logging_first_step", "logging_strategy", "log_level", "log_level_replica",
        "log_on_each_node", "logging_nan_inf_filter", "disable_tqdm", "log_completions", "num_completions_to_print",
        "wandb_log_unique_prompts", "include_tokens_per_second", "include_num_input_tokens_seen", "project",
        "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "log_multimodal", "log_unique_prompts",
        "log_completions_hub_repo", "skip_memory_metrics", "debug",
    ),
    ('the Hub: trainer.push_to_hub() reads hub_model_id, hub_private_repo, hub_token and hub_revision; '
     'training itself never pushes'): (
        "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
        "hub_revision",
    ),
    'data loading: the controller reads the rows once and hands prompts to the rollout workers': (
        "dataloader_num_workers", "dataloader_pin_memory", "remove_unused_columns", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order", "label_names",
        "length_column_name",
    ),
    ('evaluation batching and model selection: Tandem evaluates on its rollout engines (the eval section) '
     "and keeps no 'best' model"): (
        "per_device_eval_batch_size", "do_eval", "do_train", "do_predict", "eval_delay", "prediction_loss_only",
        "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics",
        "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval", "load_best_model_at_end", "metric_for_best_model",
        "greater_is_better",
    ),
    "TRL's vLLM server and its transport: Tandem starts its engines itself, in Ray actors (cluster.*)": (
        "vllm_tensor_parallel_size", "vllm_server_host", "vllm_server_port", "vllm_server_base_url",
        "vllm_server_timeout", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_group_port",
        "ds3_gather_for_generation",
    ),
    'process and device setup: Ray places the actors (cluster.*), DeepSpeed runs the learner': (
        "use_cpu", "local_rank", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
        "ddp_static_graph", "ddp_backend", "ddp_timeout", "accelerator_config", "save_on_each_node",
        "torch_empty_cache_steps", "use_cache", "torch_compile", "optim_target_modules",
        "gradient_checkpointing_kwargs", "unsloth_num_chunks", "enable_jit_checkpoint",
        "restore_callback_states_from_checkpoint",
    ),
    'checkpoint format: checkpoint-N holds safetensors weights only; the full state is in checkpoints/': (
        "save_only_model", "save_safetensors",
    ),
}
COSMETIC = {name for names in IGNORED.values() for name in names}

# TRL's AsyncGRPOConfig's own names (not GRPOConfig's): where each lives in Tandem, said beside the refusal of one given
# to a GRPOConfig (a script half moved from TRL's asynchronous trainer)
ASYNC_ONLY: dict[str, str] = {
    "max_staleness": "cluster={'max_staleness': N}, Tandem's default 1, TRL's asynchronous trainer's 4",
    "max_inflight_tasks": "cluster={'rollout_prompts_in_flight': N}, counted in prompts, not completions",
    "token_budget": "model={'max_tokens_per_forward': N}, which packs a fixed batch (TRL's budget varies the samples "
                    "a step)",
    "weight_sync_steps": "none: Tandem publishes the adapter after every generation cycle",
    "dtype": "bf16=True / fp16=True, or model={'dtype': ...}",
    "queue_maxsize": "none: max_staleness bounds what waits",
    "fork_threshold_tokens": "none: the learner trains the ids the sampler conditioned on, never re-tokenised text "
                             "(docs/tools.md)",
    "request_timeout": "none: the engines run in Ray actors Tandem starts", "weight_sync_timeout": "none",
    "heartbeat_stale_after_s": "none: Ray reports a dead actor",
}

_ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf"}
_ADAMW_8BIT = {"adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_bnb_8bit"}


def _async_hint(name: str) -> str:
    return f"{name} is TRL's AsyncGRPOConfig's; in Tandem: {ASYNC_ONLY[name]}" if name in ASYNC_ONLY else ""


def trl_to_sections(flat: dict[str, Any], caller: str | None = None) -> dict[str, Any]:
    """A flat TRL GRPOConfig dict -> Tandem's job sections (unsupported names refused, cosmetic ones warned). A name
    TRL's GRPOConfig does not have is a TypeError from Python (`caller`: the constructor called, as a dataclass
    names it), one of the refused names in a job file."""
    flat = _normalised(flat)
    out, unsupported, ignored, unknown = _sections(flat)
    if unknown and caller:
        hint = _async_hint(unknown[0])
        raise TypeError(f"{caller} got an unexpected keyword argument {unknown[0]!r}" + (f" ({hint})" if hint else ""))
    for name in unknown:
        hint = _async_hint(name)
        unsupported.append(f"{name}={flat[name]!r} (unknown GRPOConfig name{'; ' + hint if hint else ''})")
    if not unsupported:
        out.setdefault("eval", {}).update(_eval_section(flat))
    if flat.get("save_strategy") == "no":  # after the loop: save_steps may come later in the dict
        out.setdefault("checkpoint", {}).update(save_final=False, save_steps=0)
    if unsupported:
        from tandem.core.errors import JobConfigError

        raise JobConfigError("TRL config: not supported by Tandem (they change training): " + ", ".join(unsupported))
    if ignored:
        warnings.warn("TRL config: ignored (no effect on training): " + "; ".join(
            f"{', '.join(sorted(names))} ({why})" for why, names in ignored_reasons(ignored).items()),
            UserWarning, stacklevel=3)
    gbs = out.pop("_generation_batch_size", None)
    if gbs is not None:
        b = out.setdefault("batch", {})
        per = b.get("per_device_train_batch_size", 8)
        if gbs % per:
            from tandem.core.errors import JobConfigError

            raise JobConfigError(
                f"TRL config: generation_batch_size = {gbs} is not a multiple of per_device_train_batch_size = {per}"
            )
        b["steps_per_generation"] = gbs // per
    return out


def ignored_reasons(names: list[str]) -> dict[str, list[str]]:
    """{why: the names ignored for that reason}."""
    out: dict[str, list[str]] = {}
    for name in names:
        why = next((w for w, group in IGNORED.items() if name in group), "use_vllm=False: TRL generates in its own "
                   "process, Tandem in its rollout workers")
        out.setdefault(why, []).append(name)
    return out


def field_table(defaults: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every field of TRL's GRPOConfig ({name: TRL's default}) -> (name, "applied" / "ignored" / "refused", what
    Tandem does with it), in TRL's order: the table docs/trl.md shows."""
    applied = {**{k: f"`{s}.{f}`" if s else f"`{f}`" for k, (s, f) in KNOWN.items()},
               "bf16": "`model.dtype` (fp16 wins, as in transformers; both false: float32)", "fp16": "`model.dtype`",
               "vllm_mode": "`cluster.vllm_mode` where use_vllm is true (TRL's default there: colocate)",
               "eval_strategy": "'steps' or 'no' (`eval.eval_steps`; with 'no' an eval dataset is still evaluated at "
                                "the end)", "eval_steps": "`eval.eval_steps`",
               "num_generations_eval": "`eval.num_generations`", "eval_on_start": "`eval.eval_on_start`",
               "save_strategy": "'steps' or 'no' (`checkpoint.save_steps` 0, no final save)",
               "optim": f"AdamW ({', '.join(sorted(_ADAMW))}); 8-bit names run 32-bit AdamW, with a warning",
               "generation_batch_size": "`batch.steps_per_generation` = generation_batch_size / "
                                        "per_device_train_batch_size"}
    rows = []
    for name, default in defaults.items():
        if name in applied:
            rows.append((name, "applied", applied[name]))
        elif name in REFERENCE_ONLY:
            rows.append((name, "refused", f"with beta > 0, any value but TRL's default {REFERENCE_ONLY[name]!r} "
                                          "(Tandem's reference model does not move)"))
        elif name in UNSUPPORTED_NEUTRAL:
            rows.append((name, "refused", f"any value but TRL's default {UNSUPPORTED_NEUTRAL[name]!r} (not built "
                                          "in Tandem: training would differ)"))
        elif name in COSMETIC:
            rows.append((name, "ignored", next(w for w, group in IGNORED.items() if name in group)))
        else:
            rows.append((name, "unknown", ""))
    return rows


def _normalised(flat: dict[str, Any]) -> dict[str, Any]:
    """TRL's defaults for what the dict leaves out, and TRL's own aliases read as TRL reads them."""
    flat = {**{k: v for k, v in TRL_DEFAULTS.items() if k not in flat}, **flat}
    if flat.get("top_k") == 0:  # TRL's "off"
        flat["top_k"] = None
    if "vllm_importance_sampling_cap" in flat:  # deprecated in TRL for clip_max: one of the two decides
        cap = flat.pop("vllm_importance_sampling_cap")
        if cap is not None:
            flat["vllm_importance_sampling_clip_max"] = cap
    if flat.get("use_vllm") is False:  # TRL corrects only what vLLM sampled
        flat["vllm_importance_sampling_correction"] = False
    if flat.get("use_vllm") and "vllm_mode" not in flat:  # TRL's default: the engine in the trainer's process
        flat["vllm_mode"] = "colocate"
    return flat


def _sections(flat: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """-> (Tandem's sections, names refused, names ignored, names TRL's GRPOConfig does not have)."""
    out: dict[str, Any] = {}
    unsupported: list[str] = []
    ignored: list[str] = []
    unknown: list[str] = []

    def put(section: str, field: str, value: Any) -> None:
        if section:
            out.setdefault(section, {})[field] = value
        else:
            out[field] = value

    no_reference = not flat.get("beta")
    for name, value in flat.items():
        if name in REFERENCE_ONLY:
            if not (no_reference or value == REFERENCE_ONLY[name]):
                unsupported.append(f"{name}={value!r} (with beta > 0)")
        elif name in KNOWN:
            put(*KNOWN[name], value)
        elif name in SPECIAL:
            _special(name, value, flat, put, unsupported, ignored)
        elif name in UNSUPPORTED_NEUTRAL:
            if value != UNSUPPORTED_NEUTRAL[name]:
                unsupported.append(f"{name}={value!r}")
        elif name in COSMETIC:
            ignored.append(name)
        else:
            unknown.append(name)
    return out, unsupported, ignored, unknown


SPECIAL = ("bf16", "fp16", "eval_strategy", "evaluation_strategy", "eval_steps", "num_generations_eval", "eval_on_start",
           "save_strategy", "optim", "vllm_mode", "generation_batch_size")


def _special(name: str, value: Any, flat: dict[str, Any], put, unsupported: list[str], ignored: list[str]) -> None:
    """The TRL names whose meaning depends on their value or on another name (SPECIAL)."""
    if name in ("bf16", "fp16"):  # fp16 wins, as in transformers; both off: float32
        if flat.get("fp16") or flat.get("bf16"):
            put("model", "dtype", "float16" if flat.get("fp16") else "bfloat16")
        elif flat.get("bf16") is False:
            put("model", "dtype", "float32")
    elif name in ("eval_strategy", "evaluation_strategy", "save_strategy"):
        if value not in ("no", "steps"):
            unsupported.append(f"{name}={value!r} (allowed: 'steps', 'no')")
    elif name == "optim":
        if value in _ADAMW_8BIT:
            warnings.warn(f"optim = {value!r}: Tandem runs 32-bit AdamW (same update, more memory)",
                          UserWarning, stacklevel=5)
        elif value not in _ADAMW:
            unsupported.append(f"optim={value!r} (allowed: {sorted(_ADAMW | _ADAMW_8BIT)})")
    elif name == "vllm_mode":  # TRL's meaning only where vLLM samples (use_vllm=False generates in-process)
        if flat.get("use_vllm"):
            put("cluster", "vllm_mode", value)
        else:
            ignored.append(name)
    elif name == "generation_batch_size" and value is not None:
        put("", "_generation_batch_size", value)
    # eval_steps, num_generations_eval, eval_on_start: read with eval_strategy (_eval_section)


def _eval_section(flat: dict[str, Any]) -> dict[str, Any]:
    """TRL's evaluation names: eval_strategy 'steps' every eval_steps (a float below 1 is a share of
    max_steps; None falls back to logging_steps, as transformers does), num_generations_eval (None =
    num_generations). With 'no', Tandem still evaluates once at the end when an eval dataset is given."""
    strategy = flat.get("eval_strategy", flat.get("evaluation_strategy", "no"))
    out: dict[str, Any] = {"num_generations": flat.get("num_generations_eval") or flat.get("num_generations", 8),
                           "eval_on_start": bool(flat.get("eval_on_start", False))}
    if strategy == "steps":
        every = flat.get("eval_steps") or flat.get("logging_steps", 10)
        if isinstance(every, float) and every < 1:
            total = flat.get("max_steps", -1)
            if total is None or total <= 0:
                from tandem.core.errors import JobConfigError

                raise JobConfigError(f"TRL config: eval_steps = {every} (a share of the run) needs max_steps > 0")
            every = max(1, int(-(-every * total // 1)))
        out["eval_steps"] = int(every)
    return out

