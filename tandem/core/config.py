"""The job description: every GRPO parameter with the exact name and default of docs/grpo.md.

Pure on purpose (pydantic + yaml only, no disk, no user code, no CUDA probe): rollout, learner and
every CLI command import it, and a job validates the same on a laptop as on the cluster. Every
invalid value is refused when the job is loaded, with one message naming the field path, the
value and what is allowed. The one documented auto-adjustment (per_device_train_batch_size
raised to num_generations) warns loudly. What depends on the machine (paths, reward imports,
CUDA) is checked by `tandem.core.checks` in the process that uses it.
"""

from __future__ import annotations

import math
import os
import re
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.core.errors import JobConfigError
from tandem.core.plan import batch_error
from tandem.core.storage import is_uri, join, staging_dir


class JobConfigWarning(UserWarning):
    """A job that runs, but not the way a user may expect (spec's documented adjustments)."""


class _Section(BaseModel):
    # Typos in a job file are errors, not silently ignored keys.
    model_config = ConfigDict(extra="forbid", validate_default=True)


def positive_auto_or_null(name: str, v):
    """`v` of a field that takes an int >= 1, auto or null; a ValueError naming the field where it is an int < 1."""
    if isinstance(v, int) and v < 1:
        raise ValueError(f"{name} = {v}; allowed: an int >= 1, auto or null")
    return v


# ---------------------------------------------------------------------------------------- model


class LoraConfig(_Section):
    """LoRA adapter (peft names); the learner trains it and publishes it to the rollout engines."""

    r: int = Field(16, ge=1, le=1024, description="adapter rank")
    lora_alpha: float = Field(16, gt=0, description="scaling numerator: scale = lora_alpha / r")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="module names the adapter wraps",
    )


class ModelConfig(_Section):
    path: str = Field(description="a transformers causal LM: a local directory (config.json inside) every node sees "
                      "at this path, a Hub id (org/name) resolved through each node's Hugging Face cache (HF_HOME, "
                      "HF_HUB_OFFLINE), or a storage URI (s3://bucket/models/name, ...) each node copies once into "
                      "its cache (TANDEM_MODEL_CACHE); a local path wins")
    revision: str | None = Field(None, description="with a Hub id: the branch, tag or commit; null = main")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="training/inference precision; float16 needs CUDA (loss scaling)"
    )
    lora: LoraConfig | None = Field(
        default_factory=LoraConfig, description="LoRA block; null = full fine-tuning"
    )
    fast_inference: bool = Field(True, description="True: vLLM samples; False: transformers generate")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute activations in backward: true, false, or auto: on where the largest "
        "forward's activations (max_tokens_per_forward's, or a micro-batch's) would take more than 3/4 of the "
        "learner's GPU memory left (less a sharing vLLM engine's share), off on CPU (learner/memory.py; "
        "learner/gradient_checkpointing reports it)")
    padding_free: bool = Field(
        True, description="the learner packs each micro-batch's sequences into one row (positions restarting per "
        "sequence, attention within each through a variable-length kernel) instead of padding them to the longest: "
        "the same loss and gradients without computing padding (TRL SFT's name; verl's use_remove_padding); a model "
        "whose forward cannot take it is padded, with a warning")
    use_liger_kernel: bool | Literal["auto"] = Field(
        "auto", description="the learner's RMSNorm, SwiGLU and RoPE through Liger-Kernel's Triton kernels (transformers' "
        "use_liger_kernel; Tandem's own fused loss either way): auto = where liger-kernel is installed and the learner "
        "has a CUDA device, for Llama-family layers (kernels/fused_layers.py); true: required")
    max_tokens_per_forward: int | Literal["auto"] | None = Field(
        "auto", description="with padding_free: each optimizer step's sequences regrouped into forwards of at most "
        "this many tokens (a longer sequence alone), each sequence's loss weighted as in its "
        "per_device_train_batch_size micro-batch (the same loss and gradient; verl's use_dynamic_bsz); auto: as many "
        "as the GPU's memory left takes without checkpointing (at most 16,384; learner/memory.py), off a GPU "
        "per_device_train_batch_size x (max_prompt_length + max_completion_length); null: one forward per micro-batch")

    @field_validator("max_tokens_per_forward")
    @classmethod
    def _positive_tokens(cls, v):
        return positive_auto_or_null("model.max_tokens_per_forward", v)

    def local_dir(self) -> str:
        """The model's directory on this node: `path`, or its Hub snapshot (tandem.core.hub.model_dir)."""
        from tandem.core.hub import model_dir  # noqa: PLC0415 - hub imports this module

        return model_dir(self.path, self.revision)


# ----------------------------------------------------------------------------------------- data


class DataConfig(_Section):
    path: str | None = Field(description="jsonl/json/parquet file, a saved Hugging Face dataset directory, or a Hub "
                             "dataset id (org/name, read with datasets.load_dataset from each node's cache); a local "
                             "path wins; null only from Python (tandem.GRPOTrainer's train_dataset)")
    name: str | None = Field(None, description="with a Hub dataset id: its configuration (load_dataset's name)")
    split: str = Field("train", description="with a Hub dataset id: the split")
    prompt_column: str = Field(
        "prompt", description="column with the prompt: a string, or a list of chat messages"
    )
    system_prompt: str | None = Field(
        None, description="a system message put first in every prompt: before the messages of a conversational "
        "prompt that has none, or with a string prompt as its user turn (the prompt then goes through the chat "
        "template, which the tokenizer must have); null = none")
    map: str | None = Field(
        None, description="module:function or file.py:function run on every row where the data is read (as "
        "Dataset.map): row -> dict of columns to add or replace; the other columns stay for the rewards")
    shuffle: bool = Field(True, description="seeded shuffle of the prompt order each epoch")
    truncate_long_prompts: bool = Field(
        False, description="left-truncate prompts over max_prompt_length instead of refusing them"
    )


# ----------------------------------------------------------------------------------- generation


class GenerationConfig(_Section):
    """Sampling parameters (docs/grpo.md §2), the same on the vLLM and transformers engines."""

    temperature: float = Field(1.0, gt=0, le=100, description="sampling temperature; log-probs use it too")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass, in (0, 1]")
    top_k: int | None = Field(None, ge=1, description="keep the k most likely tokens; null = off")
    min_p: float | None = Field(None, ge=0, le=1, description="min prob relative to the top token's; null = off")
    repetition_penalty: float = Field(1.0, gt=0, le=10, description=">1 discourages repeated tokens")
    max_prompt_length: int = Field(512, ge=1, description="longest prompt in tokens")
    max_completion_length: int = Field(256, ge=1, description="longest completion in tokens; with tools, every token "
                                       "after the prompt, the model's and the tools' together (TRL's count)")
    seed_per_prompt: bool = Field(
        False, description="sample each prompt with a seed of its own (the job's seed and its hand-out number): a run "
        "samples the same however prompts share the engine's steps, and, with max_staleness 0, trains the same")
    max_tool_calling_iterations: int | None = Field(
        None, ge=0, description="with tools: tool rounds per episode; null = until a turn without a tool call or "
        "the max_completion_length budget")


# ---------------------------------------------------------------------------------------- batch


class BatchConfig(_Section):
    """Batch arithmetic (docs/grpo.md §3); `tandem plan` prints what it means."""

    per_device_train_batch_size: int = Field(8, ge=1, description="samples per process per micro-step")
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-steps per optimizer step")
    steps_per_generation: int | None = Field(
        None, ge=1, description="micro-steps fed by one generation batch; null = gradient_accumulation_steps"
    )
    num_generations: int = Field(8, ge=2, description="completions per prompt (the group); 2 warns")
    max_steps: int = Field(-1, ge=-1, description="optimizer steps to run; -1 = num_train_epochs over the data")

    @field_validator("max_steps")
    @classmethod
    def _trains_something(cls, v: int) -> int:
        if v == 0:
            raise ValueError("batch.max_steps = 0: trains nothing; allowed: -1 (num_train_epochs over the data) or a "
                             "number of optimizer steps >= 1")
        return v
    num_train_epochs: float = Field(3.0, gt=0, description="passes over the prompts when max_steps = -1")


# ----------------------------------------------------------------------------------------- grpo


class GRPOConfig(_Section):
    """The loss (docs/grpo.md §1, §4)."""

    beta: float = Field(0.0, ge=0, description="KL coefficient; 0 = no reference model")
    num_iterations: int = Field(1, ge=1, description="PPO epochs per generation batch (mu)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="lower clip: ratio >= 1 - epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="upper clip; null = epsilon")
    delta: float | None = Field(None, gt=1, description="two-sided GRPO cap on the unclipped ratio; null = off")
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="token or GSPO")
    reward_weights: list[float] | None = Field(None, description="one weight per reward function")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantage scaling: group std, batch std, or none (True/False accepted)"
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field("dapo", description="normalisation (§4.8)")
    mask_truncated_completions: bool = Field(False, description="truncated completions leave the loss")
    vllm_importance_sampling_correction: bool | None = Field(
        None, description="TIS; null = on exactly when vLLM samples (model.fast_inference)"
    )
    vllm_importance_sampling_cap: float = Field(2.0, gt=0, description="TIS truncation C")
    vllm_importance_sampling_clip_min: float | None = Field(
        None, gt=0, description="TIS lower bound: truncate modes raise weights to it, mask modes drop those below; "
        "null = none (TRL's name)")
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, description="off-policy sequence mask (DeepSeek-V3.2, TRL's name): a negative-advantage "
        "completion whose mean KL(sampler ‖ policy) exceeds it leaves the loss; null = off")
    overlong_buffer_len: int | None = Field(
        None, ge=1, description="DAPO's soft overlong punishment: completions within this many tokens of "
        "max_completion_length get a penalty falling linearly to -overlong_penalty_factor; null = off")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="the overlong penalty at max_completion_length")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling (verl's filter_groups): groups whose rewards all agree are not "
        "trained on; more prompts are sampled until the batch is full of informative groups")
    max_oversampling: float = Field(
        3.0, ge=1, description="with dynamic_sampling, at most this many × unique_prompts prompts per batch; then "
        "the batch is filled with filtered groups (metric dynamic_sampling/filled)")
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = Field("token_truncate", description="TIS variant (TRL's names)")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _bool_aliases(cls, v: Any) -> Any:
        if v is True:
            return "group"
        if v is False:
            return "none"
        return v

    @model_validator(mode="after")
    def _clip_order(self) -> GRPOConfig:
        hi = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        if self.delta is not None and self.delta <= 1 + hi:
            warnings.warn(
                f"grpo.delta = {self.delta} <= 1 + epsilon_high = {1 + hi}: the cap binds inside the clip "
                "region; INTELLECT-2 recommends delta > 1 + epsilon",
                JobConfigWarning,
                stacklevel=2,
            )
        return self


# ------------------------------------------------------------------------------------ optimizer


class OptimizerConfig(_Section):
    learning_rate: float = Field(1e-6, gt=0, le=1, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW decoupled weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW second-moment decay")
    adam_epsilon: float = Field(1e-8, gt=0, le=1, description="AdamW denominator epsilon")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="fraction of optimizer steps warming up")
    warmup_steps: int = Field(0, ge=0, description="warm-up steps; overrides warmup_ratio when > 0")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="learning-rate schedule after warm-up (transformers' names)")
    max_grad_norm: float = Field(1.0, ge=0, description="clip the global grad norm; 0 = off")


# -------------------------------------------------------------------------------------- cluster


class Resources(_Section):
    """What one actor asks Ray for, so an autoscaler can place rollout and learner separately."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs per actor (Ray)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (Ray); fractions share a GPU")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources")


class AutoscaleConfig(_Section):
    """Bounds of the rollout worker count the controller moves after each cycle (services/orchestrator/autoscale.py)."""

    min_rollout_workers: int = Field(1, ge=1, description="fewest rollout workers")
    max_rollout_workers: int = Field(description="most rollout workers", ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_rollout_workers > self.max_rollout_workers:
            raise ValueError(f"cluster.autoscale: min_rollout_workers = {self.min_rollout_workers} > "
                             f"max_rollout_workers = {self.max_rollout_workers}; allowed: min <= max")
        return self


class ClusterConfig(_Section):
    num_rollout_workers: int = Field(1, ge=1, description="RolloutWorker actors (at the start, with autoscale)")
    rollout_resources: Resources = Field(default_factory=Resources, description="per rollout worker")
    num_processes: int = Field(1, ge=1, description="learner processes (one DeepSpeed rank each)")
    learner_resources: Resources = Field(default_factory=Resources, description="per learner process")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage")
    max_staleness: int = Field(0, ge=0, le=16, description="policy versions a group may lag; 0 = synchronous")
    inflight_updates: bool = Field(
        True, description="at max_staleness >= 1, a published version reaches the sequences already sampling at the "
        "engine's next step (PipelineRL's in-flight weight updates, on vLLM's LoRA slot replaced in place or the merged "
        "weights reloaded): no group is stopped or dropped for staleness, each completion token carries the version "
        "that sampled it, and a token more than max_staleness versions behind the weights that train on it is masked "
        "out of the loss (docs/grpo.md); false = a group finishes under the version it started with, and one past "
        "the bound is stopped and sampled again (the transformers engine always works so)")
    max_token_lag: int | None = Field(
        None, ge=0, le=64, description="in flight, a token sampled more than this many versions before the weights that "
        "train on it is masked out of the loss (never its group); null = max_staleness + 1 (the batches max_staleness "
        "lets ahead, plus the one publish a sequence still sampling at its batch's take may cross; at max_staleness 1 "
        "a bound of 1 masked 27% of the 1.5B long tail's tokens: docs/benchmarks.md)")
    inflight_kv: Literal["recompute", "keep"] = Field(
        "recompute", description="in flight, the KV cache of the sequences running at a publish: recompute = computed "
        "again under the new weights (vLLM preempts and resumes them: each token's sampler log-prob is exactly the "
        "new policy's); keep = kept (PipelineRL's way: no recomputation, the tokens after the publish attend to keys "
        "and values of the older weights, which their sampler log-probs and TIS account for)")
    rollout_prompts_in_flight: int | None = Field(
        None, ge=1, description="prompts kept in each rollout engine at once; null = the engine's throughput plateau: "
        "vllm_max_num_seqs, else 256 sequences on a GPU (128 on a CPU), over num_generations; with tools or an "
        "environment, as many as max_staleness lets out (an episode waiting on a tool holds no sequence in the "
        "engine); max_staleness may keep fewer there (k + 1 batches outstanding at most)")
    rollout_oversample_prompts: int | Literal["auto"] = Field(
        0, description="prompts handed out beyond the k + 1 batches max_staleness lets out (max_staleness >= 1 "
        "only): a batch takes the groups that finish first, so with a long tail of lengths these stand in for the "
        "groups the bound stops (over-sampling: more out than a batch trains, the first back taken); the groups not "
        "taken in time are stopped and recorded as the bound's (`count/stale_stopped`), and training leans further "
        "to short completions. The engine's KV cache stays the plateau's: past its sequences vLLM queues them. "
        "auto = as many as keep the engine's plateau of prompts out while a batch trains (the plateau's prompts less "
        "max_staleness batches; 0 at max_staleness 0, with tools, and on a CPU)")
    vllm_enforce_eager: bool | None = Field(
        None, description="vLLM without CUDA graphs; null = eager on CPU, CUDA graphs on GPU")
    vllm_gpu_memory_utilization: float | Literal["auto"] = Field(
        "auto", description="share of the GPU vLLM takes (weights + KV cache); auto = its weights and a KV cache "
        "holding every sequence the controller keeps in the engine at full length (prompts in flight x "
        "num_generations x (max_prompt_length + max_completion_length)), so it never preempts one and a learner "
        "sharing the GPU gets the rest; a number = that share (TRL's colocate default is 0.3)")
    vllm_merge_adapter: bool | None = Field(
        None, description="vLLM samples with the adapter merged into the weights (TRL's way: one version served "
        "at a time, so publishing waits for running requests) instead of as a LoRA adapter; null = merged on CPU "
        "(vLLM's CPU LoRA kernels double a small model's step), a LoRA adapter on GPU")
    vllm_max_num_seqs: int | None = Field(
        None, ge=1, description="sequences vLLM batches at once; null = vLLM's default (256 on GPU, 128 on CPU)")
    vllm_mode: Literal["server", "colocate"] = Field(
        "server", description="TRL's name: 'server' = every rollout engine in a Ray actor of its own; 'colocate' = "
        "the first rollout worker's engine in the learner's process (one actor asking for both resources: one "
        "process importing torch, transformers and Ray fewer; needs num_processes 1; with a LoRA adapter served, not "
        "merged, the learner's frozen base weights are the engine's tensors, not a second copy). Workers beyond the "
        "first, and `tandem scale`, add server-mode ones")
    learner_sm_carveout: int | Literal["auto"] | None = Field(
        "auto", description="streaming multiprocessors the learner's matmuls leave free for a rollout engine "
        "sharing its GPU (vllm_mode colocate, or under CUDA MPS): its GEMMs go through cuBLASLt with an SM count "
        "target that many below the GPU's, so the engine's decode kernels never wait for a learner GEMM's blocks; "
        "auto = 24 of every 132 SMs in vllm_mode colocate (24 on an H100 or H200), none otherwise; "
        "null = the learner's GEMMs take every SM")
    address: str | None = Field(None, description="Ray address `tandem run` joins when --address is not given; "
                                "null = embedded Ray")
    max_restarts: int = Field(3, ge=0, le=100, description="times the job is restarted from its newest checkpoint "
                              "after the learner or the controller died (rollout workers are always replaced); "
                              "0 = stop at the first death")
    max_worker_restarts: int = Field(8, ge=0, le=1000, description="times one rollout worker is replaced in a row, "
                                     "no group coming back from it in between, before the job stops (a crash loop); "
                                     "the prompts a worker died on twice are failed, not handed out again")
    autoscale: AutoscaleConfig | None = Field(
        None, description="{min_rollout_workers, max_rollout_workers}: after each cycle one rollout worker more while "
        "the learner waited for groups longer than 0.2 x its training time, one fewer while a batch of groups "
        "waited in the buffer and the learner waited less than 0.05 x; Ray's autoscaler is asked for the "
        "resources (request_resources), so it adds and removes nodes; null = the count stays "
        "num_rollout_workers (`tandem scale` sets it by hand)")

    @model_validator(mode="after")
    def _oversample_needs_a_bound(self) -> ClusterConfig:
        if self.rollout_oversample_prompts not in (0, "auto") and self.max_staleness >= 1 and self.inflight_updates:
            raise ValueError(f"cluster.rollout_oversample_prompts = {self.rollout_oversample_prompts} with "
                             "cluster.inflight_updates: true: no group is stopped for staleness, so none needs a stand-in;"
                             " allowed: 0 or auto, or inflight_updates: false")
        if self.rollout_oversample_prompts not in (0, "auto") and self.max_staleness == 0:
            raise ValueError(f"cluster.rollout_oversample_prompts = {self.rollout_oversample_prompts} with "
                             "cluster.max_staleness = 0: a synchronous cycle trains every group it hands out; "
                             "allowed: 0 or auto, or max_staleness >= 1")
        return self

    @model_validator(mode="after")
    def _start_within_bounds(self) -> ClusterConfig:
        a = self.autoscale
        if a is not None and not a.min_rollout_workers <= self.num_rollout_workers <= a.max_rollout_workers:
            raise ValueError(f"cluster.num_rollout_workers = {self.num_rollout_workers}: outside cluster.autoscale's "
                             f"bounds [{a.min_rollout_workers}, {a.max_rollout_workers}]; allowed: a start count "
                             "within them")
        return self

    @field_validator("learner_sm_carveout")
    @classmethod
    def _positive_sms(cls, v):
        return positive_auto_or_null("cluster.learner_sm_carveout", v)

    @field_validator("rollout_oversample_prompts")
    @classmethod
    def _oversample(cls, v):
        if v != "auto" and v < 0:
            raise ValueError(f"cluster.rollout_oversample_prompts = {v}; allowed: an int >= 0 or auto")
        return v

    @field_validator("vllm_gpu_memory_utilization")
    @classmethod
    def _share(cls, v):
        if v != "auto" and not 0 < v <= 1:
            raise ValueError(f"cluster.vllm_gpu_memory_utilization = {v}; allowed: a share in (0, 1] or auto")
        return v


class CheckpointConfig(_Section):
    dir: str | None = Field(None, description="checkpoint directory; null = <output_dir>/checkpoints")
    save_steps: int = Field(0, ge=0, description="save every N optimizer steps; 0 = only at the end")
    save_total_limit: int | None = Field(2, ge=1, description="checkpoints kept; null = every one (TRL's default)")
    resume: bool = Field(False, description="continue from the newest complete checkpoint")
    allow_changed_job: bool = Field(False, description="resume even though the data, seed, model or training "
                                    "settings differ from the checkpoint's (refused otherwise, naming what changed)")
    save_final: bool = Field(True, description="write a checkpoint (and <output_dir>/adapter) at the end of the run")


class EvalConfig(_Section):
    """Evaluation during training: the eval prompts sampled on the rollout workers with the newest
    adapter, scored by the job's reward functions; never trained on."""

    path: str | None = Field(None, description="eval dataset (the forms of data.path, Hub ids included; the "
                             "same prompt column, system_prompt and map); null = no evaluation")
    name: str | None = Field(None, description="with a Hub dataset id: its configuration")
    split: str = Field("test", description="with a Hub dataset id: the split")
    eval_steps: int = Field(0, ge=0, description="evaluate every N optimizer steps (and at the end); "
                            "0 = at the end only")
    num_generations: int = Field(1, ge=1, description="completions per eval prompt")
    temperature: float | None = Field(None, ge=0, le=100, description="eval sampling temperature; "
                                      "null = generation.temperature, 0 = greedy")
    eval_on_start: bool = Field(False, description="also evaluate the starting policy, before the first step "
                                "(a metrics line of step 0; TRL's name)")


TRACKERS = ("tensorboard", "wandb", "mlflow")


class LoggingConfig(_Section):
    output_dir: str = Field("runs/tandem", description="run directory: metrics.jsonl, plot, checkpoints, the "
                            "adapter; a local path (on a cluster: one every node sees at this path) or a storage URI "
                            "every node reaches (s3://bucket/run, gs://..., file://...; credentials from each node's "
                            "environment)")
    progress: bool = Field(True, description="progress bar on the terminal")
    overwrite_output_dir: bool = Field(
        False, description="start over in an output_dir that holds an earlier run (its metrics and checkpoints "
        "are deleted); false = such a directory is refused unless checkpoint.resume (TRL's name)")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="experiment trackers besides metrics.jsonl (TRL's name): tensorboard "
        "(<output_dir>/runs), wandb (offline unless WANDB_API_KEY or WANDB_MODE says otherwise), mlflow "
        "(MLFLOW_TRACKING_URI, default <output_dir>/mlruns); 'none', 'all' or one name accepted")
    run_name: str | None = Field(None, description="the trackers' run name; null = the output_dir's name")
    group_trace: bool = Field(False, description="write <output_dir>/group_trace.jsonl, a line each time a group "
                              "comes back, is trained, or is stopped or dropped past cluster.max_staleness (its "
                              "dataset row, epoch, version, tokens, the time, the version served then): how the "
                              "pipeline spends the engines; a resumed run appends its lines")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v: Any) -> Any:
        if v is None or v == "none":
            return []
        if v == "all":
            return list(TRACKERS)
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            bad = [x for x in v if x not in TRACKERS and x != "none"]
            if bad:
                raise ValueError(f"logging.report_to = {v!r}: {bad[0]!r} is not a tracker Tandem reports to; allowed: "
                                 f"{', '.join(TRACKERS)}, 'all' or 'none'")
            return [x for x in dict.fromkeys(v) if x != "none"]
        return v


# ------------------------------------------------------------------------------------------ job


class JobConfig(_Section):
    model: ModelConfig = Field(description="the policy model (section)")
    data: DataConfig = Field(description="the prompt dataset (section)")
    rewards: list[str] = Field(min_length=1, description="reward functions: module:function or file.py:function")
    reward_timeout_s: float | None = Field(
        60.0, gt=0, description="time limit of one reward call; rewards run in child processes of each rollout "
        "worker, so a hang or crash fails only its group; null = in the worker's process, no limit")
    tools: list[str] | None = Field(
        None, min_length=1, description="tool functions (module:function or file.py:function, typed and documented "
        "as TRL's tools=): episodes of several turns, the model calling them in its chat format")
    environment: str | None = Field(
        None, description="environment class (module:Class or file.py:Class, TRL's environment_factory shape): one "
        "instance per episode, reset(**row) -> text that joins the last user message or null, its public methods "
        "the episode's tools, an optional get_reward() one more reward column of weight 1")
    tool_timeout_s: float | None = Field(
        60.0, gt=0, description="time limit of one tool call; past it the model reads an error; null = no limit")
    tool_isolation: Literal["thread", "process"] = Field(
        "thread", description="where the tools: functions run: thread = in the rollout worker (a tool that kills its "
        "process takes the worker with it); process = in child processes of the worker, so a crash or a hang fails "
        "only its call and a call past tool_timeout_s is stopped (cost: bench/tool_isolation.py)")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="sampling (section)")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="batch arithmetic (section)")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="the loss (section)")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW and schedule (section)")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="actors and resources (section)")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="saving and resume (section)")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="run directory, progress, trackers "
                                   "(section)")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation during training (section)")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="seeds the prompt order, the engines and the learner")

    @field_validator("rewards", "tools")
    @classmethod
    def _function_specs(cls, v: list[str] | None, info) -> list[str] | None:
        # the form only; importing the function runs user code (tandem.core.checks does that)
        for i, spec in enumerate(v or []):
            if not isinstance(spec, str) or ":" not in spec or not all(spec.rsplit(":", 1)):
                raise ValueError(f"{info.field_name}[{i}] = {spec!r}: expected 'module:function' or "
                                 "'path/to/file.py:function'")
        return v

    @model_validator(mode="after")
    def _isolated_tools(self) -> JobConfig:
        if self.tool_isolation == "process" and self.environment is not None:
            raise ValueError(f"tool_isolation = 'process' with environment = {self.environment!r}: an environment's "
                             "methods act on its instance in the rollout worker and cannot run in another process; "
                             "allowed: 'thread' with an environment, 'process' with tools: functions")
        return self

    @model_validator(mode="after")
    def _object_specs(self) -> JobConfig:
        for field, v, what in (("environment", self.environment, "Class"), ("data.map", self.data and self.data.map, "function")):
            if v is not None and (":" not in v or not all(v.rsplit(":", 1))):
                raise ValueError(f"{field} = {v!r}: expected 'module:{what}' or 'path/to/file.py:{what}'")
        return self

    def column_weights(self) -> list[float] | None:
        """One weight per reward column: the functions' (grpo.reward_weights), then 1.0 for the environment's
        get_reward column (TRL weighs it so); None: every column 1."""
        if self.environment is None:
            return self.grpo.reward_weights
        return list(self.grpo.reward_weights or [1.0] * len(self.rewards)) + [1.0]

    @model_validator(mode="after")
    def _cross_checks(self) -> JobConfig:
        g, b, c = self.grpo, self.batch, self.cluster
        if g.reward_weights is not None and not all(math.isfinite(w) for w in g.reward_weights):
            raise ValueError(f"grpo.reward_weights = {g.reward_weights}: every weight must be a finite number")
        if g.reward_weights is not None and self.rewards is not None and len(g.reward_weights) != len(self.rewards):
            raise ValueError(
                f"grpo.reward_weights = {g.reward_weights}: {len(g.reward_weights)} weights for "
                f"{len(self.rewards)} reward functions; give one per function or null"
            )
        if g.vllm_importance_sampling_correction is None:
            g.vllm_importance_sampling_correction = self.model.fast_inference if self.model else True
        if g.overlong_buffer_len is not None and g.overlong_buffer_len > self.generation.max_completion_length:
            raise ValueError(f"grpo.overlong_buffer_len = {g.overlong_buffer_len}: must be at most "
                             f"generation.max_completion_length = {self.generation.max_completion_length}")
        lo = g.vllm_importance_sampling_clip_min
        if lo is not None and lo >= g.vllm_importance_sampling_cap:
            raise ValueError(f"grpo.vllm_importance_sampling_clip_min = {lo}: must be below "
                             f"grpo.vllm_importance_sampling_cap = {g.vllm_importance_sampling_cap} (or null)")
        if g.epsilon_high is not None and g.epsilon_high < g.epsilon:
            raise ValueError(
                f"grpo.epsilon_high = {g.epsilon_high}: must be >= grpo.epsilon = {g.epsilon} (or null)"
            )
        e = self.eval
        if e.temperature == 0 and e.num_generations > 1:
            raise ValueError(f"eval.num_generations = {e.num_generations} with eval.temperature = 0 (greedy): every "
                             "sample would be the same; allowed: num_generations 1, or a temperature > 0")
        if b.num_generations == 2:
            warnings.warn(
                "batch.num_generations = 2: allowed, but GRPO needs > 2 completions per prompt to work well",
                JobConfigWarning,
                stacklevel=2,
            )
        if c.vllm_mode == "colocate" and c.num_processes != 1:
            raise ValueError(f"cluster.vllm_mode = 'colocate' with cluster.num_processes = {c.num_processes}: the "
                             "engine shares the learner's one process; allowed: num_processes 1, or vllm_mode 'server'")
        resolve_batch(b, g.num_iterations, c.num_processes)
        return self

    # --------------------------------------------------------------------------------- loading

    @property
    def tis(self) -> bool:
        return bool(self.grpo.vllm_importance_sampling_correction)

    @property
    def checkpoint_dir(self) -> str:
        """A local path or a storage URI (tandem.core.storage)."""
        return self.checkpoint.dir or join(self.logging.output_dir, "checkpoints")

    @property
    def run_dir(self) -> str:
        """Where this node writes the run's files: output_dir, or for a storage URI this node's staging directory
        (copied to the URI by storage.RunMirror)."""
        out = self.logging.output_dir
        return str(staging_dir(out)) if is_uri(out) else out

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: list[str] | None = None) -> JobConfig:
        data = _deep_copy(data)
        for item in overrides or []:
            apply_override(data, item)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cfg = cls.model_validate(data)
        except ValidationError as e:
            raise JobConfigError(format_validation_error(e, cls)) from None
        for w in caught:  # re-issue once, outside pydantic's frames
            warnings.warn(w.message, w.category, stacklevel=2)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> JobConfig:
        return cls.from_dict(read_job_file(path), overrides)

    @classmethod
    def from_trl(cls, flat: dict[str, Any], **sections: Any) -> JobConfig:
        """A flat TRL/Unsloth GRPOConfig-style dict (plus model/data/rewards sections) as a job."""
        from tandem.core.trl import trl_to_sections  # noqa: PLC0415 - trl imports this module

        data = trl_to_sections(flat)
        for name, value in sections.items():
            data.setdefault(name, {})
            if isinstance(value, dict) and isinstance(data[name], dict):
                data[name].update(value)
            else:
                data[name] = value
        return cls.from_dict(data)


class JobShape(JobConfig):
    """A job file whose inputs may be left out (model, data, rewards): what `tandem plan` reads. The
    same schema otherwise: every section present is validated in full, typos included."""

    model: ModelConfig | None = Field(None, description="the policy model (section)")
    data: DataConfig | None = Field(None, description="the prompt dataset (section)")
    rewards: list[str] | None = Field(None, min_length=1, description="reward functions")


# ------------------------------------------------------------------------------------- helpers


def with_absolute_paths(cfg: JobConfig, base: str | os.PathLike) -> JobConfig:
    """The job with its relative paths (model, data, eval, reward files, run and checkpoint directories)
    made absolute against `base`, the driver's working directory: actors on a cluster start elsewhere
    (`tandem run --address` joined a `ray start` whose workers run in another directory)."""
    b = Path(base)

    from tandem.core.hub import is_hub_id  # noqa: PLC0415 - hub imports this module

    def absolute(v):
        return v if v is None or Path(v).is_absolute() or is_uri(v) else str(b / v)

    def local_or_hub(v):  # a local path wins; a Hub id stays a name
        return v if v is not None and not (b / v).exists() and is_hub_id(v) else absolute(v)

    def function(spec: str) -> str:
        target, sep, name = spec.rpartition(":")
        return f"{absolute(target)}{sep}{name}" if target.endswith((".py", ".pkl")) else spec
    return cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": local_or_hub(cfg.model.path)}),
        "data": cfg.data.model_copy(update={"path": local_or_hub(cfg.data.path),
                                            "map": None if cfg.data.map is None else function(cfg.data.map)}),
        "eval": cfg.eval.model_copy(update={"path": local_or_hub(cfg.eval.path)}),
        "rewards": [function(r) for r in cfg.rewards],
        "tools": None if cfg.tools is None else [function(t) for t in cfg.tools],
        "environment": None if cfg.environment is None else function(cfg.environment),
        "logging": cfg.logging.model_copy(update={"output_dir": absolute(cfg.logging.output_dir)}),
        "checkpoint": cfg.checkpoint.model_copy(update={"dir": absolute(cfg.checkpoint.dir)}),
    })


def read_job_file(path: str | os.PathLike) -> dict[str, Any]:
    """The one reader of job files: a YAML mapping of sections, unvalidated."""
    p = Path(path)
    if not p.is_file():
        raise JobConfigError(f"job file {str(p)!r}: not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise JobConfigError(f"job file {str(p)!r}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise JobConfigError(f"job file {str(p)!r}: must be a mapping of sections, got {type(data).__name__}")
    return data



def resolve_batch(b: BatchConfig, num_iterations: int, num_processes: int) -> None:
    """docs/grpo.md §3: fills steps_per_generation, applies the one documented adjustment, then the checks
    (one implementation, shared with BatchPlan)."""
    if b.steps_per_generation is None:
        b.steps_per_generation = b.gradient_accumulation_steps
    G, per = b.num_generations, b.per_device_train_batch_size
    ebs = b.steps_per_generation * num_processes * per
    if ebs % G and per < G:
        warnings.warn(
            f"batch.per_device_train_batch_size = {per} raised to num_generations = {G}: "
            f"effective_batch_size {ebs} was not divisible by {G} (docs/grpo.md §3)",
            JobConfigWarning,
            stacklevel=3,
        )
        b.per_device_train_batch_size = G
    err = batch_error(b.per_device_train_batch_size, b.gradient_accumulation_steps, b.steps_per_generation, G,
                      num_processes, num_iterations)
    if err:
        raise ValueError(err)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def apply_override(data: dict[str, Any], item: str) -> None:
    """`grpo.beta=0.04`: the value is parsed as YAML (numbers, true/false, null, lists)."""
    if "=" not in item:
        raise JobConfigError(f"--set {item!r}: expected section.field=value, e.g. grpo.beta=0.04")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise JobConfigError(f"--set {item!r}: empty name in {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise JobConfigError(f"--set {item!r}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


# pydantic names each member of a union a value failed after the field (`cluster.x.int`, `cluster.x.literal['auto']`)
_UNION_MEMBER = re.compile(r"(int|float|str|bool|none|literal\[.*\])")


def _takes_null(model: type[BaseModel], path: tuple) -> bool:
    """Whether the field at `path` (section names, then the field's) of `model` takes null."""
    for part in path[:-1]:
        section = getattr(model.model_fields.get(str(part)), "annotation", None)
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return False
        model = section
    field = model.model_fields.get(str(path[-1]))
    return field is not None and type(None) in typing.get_args(field.annotation)


def format_validation_error(e: ValidationError, model: type[BaseModel] | None = None) -> str:
    """pydantic's errors as one line: the field, the value, what is allowed (model: the validated class, whose fields
    say where a union also takes null)."""
    lines: list = []  # a line, or (field, value) of a union's line
    union: dict[str, list[str]] = {}  # field -> what each member of its union allows, said in one line
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error":  # our own validators already name field and value
            lines.append(msg)
        elif err["type"] == "missing":
            lines.append(f"{loc}: required field missing")
        elif err["type"] == "too_short" and isinstance(err["input"], list):  # an empty list where one entry is needed
            what = (model.model_fields.get(str(err["loc"][-1])) if model is not None and len(err["loc"]) == 1
                    else None)
            lines.append(f"{loc} = {err['input']!r}: needs at least {err['ctx'].get('min_length', 1)} entry"
                         + (f" ({what.description})" if what is not None and what.description else "")
                         + ("; or leave it out (null)" if model is not None and _takes_null(model, (str(err['loc'][0]),))
                            else ""))
        elif err["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown field (value {err['input']!r}); check the spelling against the reference")
        elif len(err["loc"]) > 1 and _UNION_MEMBER.fullmatch(str(err["loc"][-1])):
            field = ".".join(str(x) for x in err["loc"][:-1])
            if field not in union:
                union[field] = []
                lines.append((field, err["input"]))  # its place among the lines, filled in below
            union[field].append(msg.removeprefix("Input should be ").split(",")[0])
        else:
            allowed = msg.removeprefix("Input should be ")
            lines.append(f"{loc} = {err['input']!r}: must be {allowed}")
    def union_line(field: str, value) -> str:
        null = ["null"] if model is not None and _takes_null(model, tuple(field.split("."))) else []
        return f"{field} = {value!r}: must be {' or '.join(union[field] + null)}"

    return "invalid job: " + "; ".join(ln if isinstance(ln, str) else union_line(*ln) for ln in lines)
