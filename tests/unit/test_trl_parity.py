"""A config ported from TRL means what TRL means: trl.GRPOConfig's own printed defaults are accepted and
land on the same values; the TIS lower bound and the off-policy sequence mask match TRL's formulas."""

import math
import warnings

import pytest
import torch

from tandem.core.config import JobConfig, JobConfigError
from tandem.learner.grpo import off_policy_mask, per_token_loss, tis_weight

trl = pytest.importorskip("trl")  # in the dev extra: `make install` has it


def trl_defaults() -> dict:
    return trl.GRPOConfig(output_dir="/tmp/tandem-trl-parity", use_cpu=True, bf16=False).to_dict()


def test_a_dict_printed_from_trl_grpoconfig_is_accepted(job_files):
    d = trl_defaults()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = JobConfig.from_trl(d, model=job_files["model"], data=job_files["data"], rewards=job_files["rewards"])
    g, gen, b, o = cfg.grpo, cfg.generation, cfg.batch, cfg.optimizer
    assert gen.top_k is None and d["top_k"] == 0  # TRL's 0 = off
    assert gen.max_completion_length == d["max_completion_length"] == 512
    assert (g.vllm_importance_sampling_mode, g.vllm_importance_sampling_cap) == (
        d["vllm_importance_sampling_mode"], d["vllm_importance_sampling_clip_max"])
    assert g.vllm_importance_sampling_clip_min == d["vllm_importance_sampling_clip_min"]
    assert g.off_policy_mask_threshold == d["off_policy_mask_threshold"]
    for name in ("beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "num_iterations",
                 "importance_sampling_level", "mask_truncated_completions"):
        assert getattr(g, name) == d[name], name
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_steps",
                 "num_train_epochs"):
        assert getattr(b, name) == d[name], name
    for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
                 "lr_scheduler_type", "warmup_steps"):
        assert getattr(o, name) == d[name], name
    assert cfg.model.fast_inference is d["use_vllm"] is False
    assert g.vllm_importance_sampling_correction is False  # TRL corrects only what vLLM sampled
    assert cfg.model.gradient_checkpointing is d["gradient_checkpointing"] is True
    assert cfg.model.use_liger_kernel is d["use_liger_kernel"] is False  # TRL's; true asks for Liger's layers
    assert JobConfig.from_trl({**d, "use_liger_kernel": True}, **job_files).model.use_liger_kernel is True
    assert cfg.checkpoint.save_steps == d["save_steps"] and cfg.seed == d["seed"]
    assert cfg.checkpoint.save_total_limit is d["save_total_limit"] is None  # keep every checkpoint


def test_keys_left_out_take_trls_defaults_and_the_cap_is_an_alias(job_files):
    cfg = JobConfig.from_trl({"use_vllm": True}, **job_files)
    assert (cfg.grpo.vllm_importance_sampling_mode, cfg.grpo.vllm_importance_sampling_cap) == ("sequence_mask", 3.0)
    assert cfg.generation.max_completion_length == 512 and cfg.grpo.vllm_importance_sampling_correction is True
    cfg = JobConfig.from_trl({"vllm_importance_sampling_cap": 2.5}, **job_files)
    assert cfg.grpo.vllm_importance_sampling_cap == 2.5
    cfg = JobConfig.from_trl({"vllm_importance_sampling_clip_max": 4.0, "vllm_importance_sampling_clip_min": 0.5,
                              "off_policy_mask_threshold": 0.3}, **job_files)
    assert (cfg.grpo.vllm_importance_sampling_cap, cfg.grpo.vllm_importance_sampling_clip_min,
            cfg.grpo.off_policy_mask_threshold) == (4.0, 0.5, 0.3)
    # Tandem's own job files keep the spec's defaults
    own = JobConfig.from_dict(job_files)
    assert (own.grpo.vllm_importance_sampling_mode, own.grpo.vllm_importance_sampling_cap) == ("token_truncate", 2.0)


def test_training_changes_trl_has_and_tandem_lacks_are_refused(job_files):
    with pytest.raises(JobConfigError, match="entropy_coef=0.1"):
        JobConfig.from_trl({"entropy_coef": 0.1}, **job_files)
    with pytest.raises(JobConfigError, match="use_bias_correction_kl=True \\(with beta > 0\\)"):
        JobConfig.from_trl({"beta": 0.04, "use_bias_correction_kl": True}, **job_files)
    JobConfig.from_trl({"beta": 0.0, "use_bias_correction_kl": True}, **job_files)  # no reference: no effect
    with pytest.raises(JobConfigError, match="vllm_importance_sampling_clip_min = 3.5: must be below"):
        JobConfig.from_dict({**job_files, "grpo": {"vllm_importance_sampling_clip_min": 3.5,
                                                   "vllm_importance_sampling_cap": 3.0}})


def trl_is_ratio(old, sampler, mask, mode, lo, hi):
    """TRL 1.16's vLLM importance-sampling ratio (grpo_trainer.py), float64, written out here."""
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=lo, max=hi).expand_as(old)
    bad = (r < (lo if lo is not None else -math.inf)) | (r > (hi if hi is not None else math.inf))
    return r.masked_fill(bad, 0.0).expand_as(old)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("lo", [None, 0.7])
def test_tis_lower_bound_matches_trl(mode, lo):
    g = torch.Generator().manual_seed(3)
    B, T = 32, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampler = old + torch.randn(B, T, generator=g, dtype=torch.float64) * (0.15 if mode.startswith("seq") else 0.6)
    mask = torch.rand(B, T, generator=g) > 0.2
    got = tis_weight(old, sampler, mask, 2.0, mode, lo)
    want = trl_is_ratio(old, sampler, mask.double(), mode, lo, 2.0)
    assert torch.allclose(got[mask], want[mask], rtol=0, atol=1e-12)
    if lo is not None and mode.endswith("truncate"):
        assert (got[mask] >= lo - 1e-12).all() and (want[mask] == lo).any()  # the bound bit somewhere


def test_off_policy_mask_matches_trls_own_function():
    from trl.trainer.grpo_trainer import GRPOTrainer

    g = torch.Generator().manual_seed(5)
    B, T = 16, 7
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    sampler = logp + torch.randn(B, T, generator=g, dtype=torch.float64).abs() * torch.rand(B, 1, generator=g,
                                                                                           dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    want = GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), logp, sampler, mask.double(), 0.3)
    got = off_policy_mask(adv, logp, sampler, mask, 0.3)
    assert torch.equal(got, want) and 0 < want.sum() < B  # some kept, some dropped
    # in the loss: a dropped completion contributes nothing, a kept one what it did without the mask
    old = logp.detach() + 0.01
    with_mask = per_token_loss(logp, old, adv, mask, off_policy_threshold=0.3, behaviour_logp=sampler)
    plain = per_token_loss(logp, old, adv, mask)
    keep = want.squeeze(1).bool()
    assert torch.equal(with_mask[keep], plain[keep]) and (with_mask[~keep] == 0).all()


def test_save_strategy_no_turns_off_saving(job_files):
    cfg = JobConfig.from_trl({"save_strategy": "no", "save_steps": 100}, **job_files)
    assert cfg.checkpoint.save_final is False and cfg.checkpoint.save_steps == 0
    assert JobConfig.from_dict(job_files).checkpoint.save_final is True
