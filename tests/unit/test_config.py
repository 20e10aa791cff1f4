"""Job config: spec names and defaults, validation messages, overrides, TRL mapping."""

import copy
import warnings

import pytest
import yaml

from tandem.core.checks import check_inputs, check_learner_device
from tandem.core.config import JobConfig, JobConfigError, JobConfigWarning


def load(d, overrides=None):
    return JobConfig.from_dict(d, overrides)


def test_spec_defaults(job_files):
    cfg = load(job_files)
    g, gen, b = cfg.grpo, cfg.generation, cfg.batch
    assert (g.beta, g.num_iterations, g.epsilon, g.epsilon_high, g.delta) == (0.0, 1, 0.2, None, None)
    assert g.importance_sampling_level == "token" and g.reward_weights is None
    assert g.scale_rewards == "group" and g.loss_type == "dapo" and g.mask_truncated_completions is False
    assert g.vllm_importance_sampling_cap == 2.0
    assert (gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty) == (1.0, 1.0, None, None, 1.0)
    # steps_per_generation None => gradient_accumulation_steps
    assert b.steps_per_generation == b.gradient_accumulation_steps
    assert cfg.model.fast_inference is True


def test_tis_default_follows_engine(job_files):
    assert load(job_files).grpo.vllm_importance_sampling_correction is True
    d = copy.deepcopy(job_files)
    d["model"]["fast_inference"] = False
    assert load(d).grpo.vllm_importance_sampling_correction is False
    d["grpo"] = {"vllm_importance_sampling_correction": True}
    assert load(d).grpo.vllm_importance_sampling_correction is True


@pytest.mark.parametrize("value,expected", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_aliases(job_files, value, expected):
    assert load(job_files, [f"grpo.scale_rewards={str(value).lower() if isinstance(value, bool) else value}"]
                ).grpo.scale_rewards == expected


def test_overrides_and_yaml(job_files, tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job_files))
    cfg = JobConfig.from_yaml(p, ["grpo.beta=0.04", "generation.top_k=5", "grpo.epsilon_high=0.28"])
    assert cfg.grpo.beta == 0.04 and cfg.generation.top_k == 5 and cfg.grpo.epsilon_high == 0.28
    with pytest.raises(JobConfigError, match="grpo.beta"):
        JobConfig.from_yaml(p, ["grpo.beta=-1"])
    with pytest.raises(JobConfigError, match="expected section.field=value"):
        JobConfig.from_yaml(p, ["grpo.beta"])


def test_num_generations_two_warns(job_files):
    with pytest.warns(JobConfigWarning, match="num_generations = 2"):
        load(job_files, ["batch.num_generations=2", "batch.per_device_train_batch_size=2"])


def test_batch_raised_to_num_generations(job_files):
    # 1 × 1 × 3 = 3 not divisible by 4 and 3 < 4 => raised to 4 with a warning
    with pytest.warns(JobConfigWarning, match="raised to num_generations = 4"):
        cfg = load(job_files, ["batch.num_generations=4", "batch.per_device_train_batch_size=3"])
    assert cfg.batch.per_device_train_batch_size == 4


def test_seed_example_3_keeps_three(job_files):
    # 4 × 1 × 3 = 12 divisible by 4: stays 3 (docs/grpo.md §3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(job_files, ["batch.num_generations=4", "batch.per_device_train_batch_size=3",
                               "batch.gradient_accumulation_steps=4"])
    assert cfg.batch.per_device_train_batch_size == 3


def test_not_divisible_proposes(job_files):
    with pytest.raises(JobConfigError, match=r"try batch.per_device_train_batch_size in \[6, 3\]"):
        load(job_files, ["batch.num_generations=3", "batch.per_device_train_batch_size=5"])


def test_delta_warning(job_files):
    with pytest.warns(JobConfigWarning, match="delta"):
        load(job_files, ["grpo.delta=1.1"])


# 30 invalid jobs: (override or mutation, text the message must contain)
INVALID = [
    ("grpo.beta=-0.1", "grpo.beta"),
    ("grpo.num_iterations=0", "grpo.num_iterations"),
    ("grpo.epsilon=0", "grpo.epsilon"),
    ("grpo.epsilon=1.5", "grpo.epsilon"),
    ("grpo.epsilon_high=0.1", "grpo.epsilon_high"),
    ("grpo.delta=0.5", "grpo.delta"),
    ("grpo.importance_sampling_level=tokens", "grpo.importance_sampling_level"),
    ("grpo.scale_rewards=mean", "grpo.scale_rewards"),
    ("grpo.loss_type=ppo", "grpo.loss_type"),
    ("grpo.vllm_importance_sampling_cap=0", "grpo.vllm_importance_sampling_cap"),
    ("grpo.vllm_importance_sampling_mode=clip", "grpo.vllm_importance_sampling_mode"),
    ("grpo.reward_weights=[1.0, 2.0]", "grpo.reward_weights"),
    ("generation.temperature=0", "generation.temperature"),
    ("generation.top_p=0", "generation.top_p"),
    ("generation.top_p=1.5", "generation.top_p"),
    ("generation.top_k=0", "generation.top_k"),
    ("generation.min_p=2", "generation.min_p"),
    ("generation.repetition_penalty=0", "generation.repetition_penalty"),
    ("generation.max_completion_length=0", "generation.max_completion_length"),
    ("generation.max_prompt_length=-3", "generation.max_prompt_length"),
    ("batch.num_generations=1", "batch.num_generations"),
    ("batch.per_device_train_batch_size=0", "batch.per_device_train_batch_size"),
    ("batch.gradient_accumulation_steps=0", "batch.gradient_accumulation_steps"),
    ("batch.steps_per_generation=3", "gradient_accumulation_steps"),  # with GA=2 below
    ("optimizer.learning_rate=0", "optimizer.learning_rate"),
    ("optimizer.adam_beta2=1.0", "optimizer.adam_beta2"),
    ("optimizer.lr_scheduler_type=step", "optimizer.lr_scheduler_type"),
    ("cluster.zero_stage=4", "cluster.zero_stage"),
    ("cluster.num_processes=0", "cluster.num_processes"),
    ("cluster.max_staleness=-1", "cluster.max_staleness"),
    ("model.dtype=float64", "model.dtype"),
    ("model.lora.r=0", "model.lora.r"),
    ("model.lora.lora_dropout=1", "model.lora.lora_dropout"),
    ("rewards=['no_colon']", "rewards[0]"),
    ("grpo.bta=0.1", "grpo.bta"),
    ("seed=-1", "seed"),
    ("checkpoint.save_total_limit=0", "checkpoint.save_total_limit"),
]


# jobs the schema accepts and the machine cannot run: refused by tandem.core.checks (tandem check, the
# controller, the workers), with the same messages the schema gave when it checked them itself
ENVIRONMENT = [
    ("model.path=/nonexistent/model", "model.path"),
    ("data.path=/nonexistent/data.jsonl", "data.path"),
    ("rewards=['nosuchmodule_xyz:fn']", "rewards[0]"),
    ("rewards=['math:nosuchfunction']", "rewards[0]"),
]


def load_checked(path, overrides):
    cfg = JobConfig.from_yaml(path, overrides)
    check_inputs(cfg)
    return cfg


@pytest.mark.parametrize("override,field", INVALID + ENVIRONMENT, ids=[o for o, _ in INVALID + ENVIRONMENT])
def test_invalid_job_file_named(job_files, tmp_path, override, field):
    d = copy.deepcopy(job_files)
    d["batch"] = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 8}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    if (override, field) in ENVIRONMENT:  # the schema is pure: it passes a job this machine cannot run
        JobConfig.from_yaml(p, [override])
    with pytest.raises(JobConfigError) as e:
        load_checked(p, [override])
    msg = str(e.value)
    assert field in msg, msg
    value = override.split("=", 1)[1].strip("[]'")
    if field != "gradient_accumulation_steps":  # the cross-field message names both values instead
        assert value.split(",")[0].strip("'") in msg, msg


def test_float16_on_cpu_refused(job_files):
    import torch

    cfg = load(job_files, ["model.dtype=float16"])  # a job for a GPU cluster validates on any machine
    assert cfg.model.dtype == "float16"
    if torch.cuda.is_available():
        check_learner_device(cfg)
    else:  # where the learner runs, it is refused
        with pytest.raises(JobConfigError, match="model.dtype = 'float16'.*needs CUDA"):
            check_learner_device(cfg)


def test_not_a_mapping(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(JobConfigError, match="must be a mapping"):
        JobConfig.from_yaml(p)
    with pytest.raises(JobConfigError, match="not found"):
        JobConfig.from_yaml(tmp_path / "missing.yaml")


UNSLOTH_SEED = dict(
    learning_rate=5e-6, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1,
    lr_scheduler_type="cosine", optim="adamw_torch", logging_steps=1, per_device_train_batch_size=3,
    gradient_accumulation_steps=4, num_generations=4, max_prompt_length=256, max_completion_length=200,
    max_steps=250, save_steps=250, max_grad_norm=0.1, report_to="none", output_dir="outputs",
    beta=0.04, num_iterations=2, epsilon=0.2, epsilon_high=0.28, delta=1.5, importance_sampling_level="sequence",
    scale_rewards="batch", loss_type="dr_grpo", mask_truncated_completions=True,
    vllm_importance_sampling_correction=True, vllm_importance_sampling_cap=2.0, temperature=1.0, top_p=0.95,
    top_k=50, min_p=0.1, repetition_penalty=1.1, steps_per_generation=4, bf16=True, seed=3407,
    reward_weights=[1.0],
)


def test_from_trl_maps_seed_parameters(job_files):
    with pytest.warns(UserWarning, match="ignored .*logging_steps"):
        cfg = JobConfig.from_trl(UNSLOTH_SEED, model={**job_files["model"], "dtype": "bfloat16"},
                                 data=job_files["data"], rewards=job_files["rewards"])
    by_section = {
        "grpo": cfg.grpo, "generation": cfg.generation, "batch": cfg.batch, "optimizer": cfg.optimizer,
    }
    from tandem.core.trl import KNOWN

    for name, value in UNSLOTH_SEED.items():
        if name in KNOWN:
            section, field = KNOWN[name]
            obj = by_section.get(section) or (cfg.checkpoint if section == "checkpoint" else
                                              cfg.logging if section == "logging" else cfg)
            want = [] if (name, value) == ("report_to", "none") else value  # TRL's "none": the empty list
            assert getattr(obj, field) == want, name
    assert cfg.model.dtype == "bfloat16" and cfg.seed == 3407


def test_from_trl_unsupported_listed(job_files):
    bad = {**UNSLOTH_SEED, "top_entropy_quantile": 0.2, "sync_ref_model": True, "frobnicate": 1}
    with pytest.raises(JobConfigError) as e:
        JobConfig.from_trl(bad, **job_files)
    for name in ("top_entropy_quantile", "sync_ref_model", "frobnicate"):
        assert name in str(e.value)


def test_from_trl_generation_batch_size(job_files):
    cfg = JobConfig.from_trl({"per_device_train_batch_size": 4, "generation_batch_size": 16,
                              "gradient_accumulation_steps": 2, "num_generations": 4}, **job_files)
    assert cfg.batch.steps_per_generation == 4


def test_a_fresh_run_refuses_a_used_run_directory(job_files, tmp_path):
    """Checked before anything starts (tandem run's driver, the controller's setup): a second run into the
    same output_dir is refused unless it resumes or overwrites."""
    d = copy.deepcopy(job_files)
    d["logging"] = {"output_dir": str(tmp_path / "run")}
    check_inputs(load(d))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(JobConfigError, match="holds an earlier run .*metrics.jsonl.*checkpoint.resume: true"):
        check_inputs(load(d))
    check_inputs(load(d, ["checkpoint.resume=true"]))
    check_inputs(load(d, ["logging.overwrite_output_dir=true"]))
    (tmp_path / "run" / "metrics.jsonl").unlink()
    ck = tmp_path / "run" / "checkpoints" / "cycle-000004"
    ck.mkdir(parents=True)
    check_inputs(load(d))  # a checkpoint still being written is no earlier run
    (ck / "tandem.json").write_text("{}")
    with pytest.raises(JobConfigError, match="cycle-000004"):
        check_inputs(load(d))
    (tmp_path / "file").write_text("x")
    with pytest.raises(JobConfigError, match="a file, not a directory"):
        check_inputs(load(d, [f"logging.output_dir={tmp_path / 'file'}"]))


def test_oversampling_needs_a_staleness_bound(job_files):
    d = copy.deepcopy(job_files)
    d["cluster"] = {**d.get("cluster", {}), "rollout_oversample_prompts": 8}
    with pytest.raises(JobConfigError, match=r"cluster.rollout_oversample_prompts = 8 with cluster.max_staleness = 0"
                                             r".*allowed: 0 or auto, or max_staleness >= 1"):
        load(d)
    d["cluster"]["max_staleness"] = 1  # in flight (the default) no group is stopped: nothing to stand in for
    with pytest.raises(JobConfigError, match=r"cluster.rollout_oversample_prompts = 8 with cluster.inflight_updates: "
                                             r"true.*allowed: 0 or auto, or inflight_updates: false"):
        load(d)
    d["cluster"]["inflight_updates"] = False
    assert load(d).cluster.rollout_oversample_prompts == 8
    d["cluster"]["rollout_oversample_prompts"] = -1
    with pytest.raises(JobConfigError, match=r"cluster.rollout_oversample_prompts = -1; allowed: an int >= 0 or auto"):
        load(d)
    # auto is none at max_staleness 0: no error there
    d["cluster"].update(rollout_oversample_prompts="auto", max_staleness=0)
    assert load(d).cluster.rollout_oversample_prompts == "auto"


def test_a_value_no_member_of_a_union_takes_is_one_line_naming_the_field_and_what_it_takes(job_files):
    """pydantic says a union's refusal once per member, each under a name of its own (`...prompts.int`,
    `...prompts.literal['auto']`): the user reads one line per field, with null where the field takes it."""
    d = copy.deepcopy(job_files)
    d["model"] = {**d["model"], "max_tokens_per_forward": "big"}
    d["cluster"] = {**d.get("cluster", {}), "max_staleness": 1, "rollout_oversample_prompts": "Auto",
                    "vllm_gpu_memory_utilization": "most", "num_generations_typo": 3}
    with pytest.raises(JobConfigError) as e:
        load(d)
    assert str(e.value) == "invalid job: " + "; ".join([
                    "model.max_tokens_per_forward = 'big': must be a valid integer or 'auto' or null",
                    "cluster.rollout_oversample_prompts = 'Auto': must be a valid integer or 'auto'",
                    "cluster.vllm_gpu_memory_utilization = 'most': must be a valid number or 'auto'",
                    "cluster.num_generations_typo: unknown field (value 3); check the spelling against the reference"])
    d = copy.deepcopy(job_files)
    d["cluster"] = {"max_staleness": 1, "rollout_oversample_prompts": 1.5}  # a detail after its comma is left out
    with pytest.raises(JobConfigError, match=r"^invalid job: cluster.rollout_oversample_prompts = 1.5: must be a "
                                             r"valid integer or 'auto'$"):
        load(d)


def test_an_empty_list_is_refused_naming_the_field_and_what_it_needs(job_files):
    """`rewards: []`, `tools: []` and TRL's `reward_funcs=[]`: one line naming the field and what it takes, not
    pydantic's "List should have at least 1 item after validation"."""
    d = copy.deepcopy(job_files)
    d["rewards"] = []
    with pytest.raises(JobConfigError, match=r"^invalid job: rewards = \[\]: needs at least 1 entry \(reward functions"):
        load(d)
    d = copy.deepcopy(job_files)
    d["tools"] = []
    with pytest.raises(JobConfigError, match=r"tools = \[\]: needs at least 1 entry \(tool functions.*or leave it out"):
        load(d)
    from tandem.services.app.trainer import as_list

    with pytest.raises(JobConfigError, match=r"GRPOTrainer\(reward_funcs=\[\]\): at least one is required"):
        as_list([], "reward_funcs")
