"""GRPO's math in one home (docs/grpo.md §4), pure tensors: no Ray, no DeepSpeed. In the order a batch meets it:
the advantages of the whole generation batch (§4.1-4.2; the reward total itself is tandem/core/shaping.py's, which
the rollout worker's filter and the evaluation share), then per micro-batch the ratio, the clipped surrogate,
truncated importance sampling, the KL term (§4.3-4.7), their aggregation by loss_type (§4.8) and the metrics (§5).
The per-token term is written once, `token_term`: per_token_loss ([B, T] rows, sequence-level ratios, the
off-policy mask) and grpo_token_terms (flat chunks of tokens, the chunked lm_head path of learner/logprobs.py) both
call it. Its one other form is the Triton kernel's `_grpo_token` (kernels/triton_logprobs.py), on CUDA, tested
against per_token_loss over every loss type and option, forward and gradient (tests/unit/test_kernels_triton.py,
interpreted on a CPU). A new clipping variant is one term here, the same term in `_grpo_token`, and its config field.

Shapes: B completions (rows) × T completion positions; `mask` is 1 on real completion tokens.
Masked positions may hold anything (inf, NaN, 1e9): they are replaced before any arithmetic,
so neither the value nor the gradient can see them.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.core import shaping
from tandem.core.config import GRPOConfig
from tandem.core.shaping import overlong_penalty
from tandem.kernels.logprobs import TisFromLogp, truncated_is

# ------------------------------------------------------------------------------ advantages (§4.1-4.2)

STD_EPS = 1e-4  # added to the std before dividing (TRL/Unsloth)


def _scale_mode(scale_rewards: str | bool) -> str:
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(
            f"compute_advantages: scale_rewards = {scale_rewards!r}; allowed 'group', 'batch', 'none', True, False"
        )
    return scale_rewards


def total_rewards(
    rewards: torch.Tensor, reward_weights: Sequence[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, F] per-function rewards (NaN = None) -> (weighted nansum [N] float64, valid [N]: some function
    scored), as tensors: tandem.core.shaping.total_rewards (the one definition) on the rewards' host copy."""
    n_fn = 1 if rewards.dim() == 1 else rewards.shape[1]
    if reward_weights is not None and len(reward_weights) != n_fn:
        raise ValueError(f"compute_advantages: {len(reward_weights)} reward_weights for {n_fn} reward columns")
    total, valid = shaping.total_rewards(rewards.detach().to("cpu", torch.float64).numpy(), reward_weights)
    return torch.from_numpy(total).to(rewards.device), torch.from_numpy(valid).to(rewards.device)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    reward_weights: Sequence[float] | None = None,
    scale_rewards: str | bool = "group",
) -> torch.Tensor:
    """rewards [N, F] (NaN where a function returned None) -> advantages [N].

    A_i = r_i − mean(group), divided by (Bessel std + 1e-4) of the group ("group") or of the
    whole batch ("batch"). Rows where every function returned None get 0 and stay out of every
    statistic; groups whose valid rewards are all equal get exactly 0. Computed in float64.
    """
    mode = _scale_mode(scale_rewards)
    if num_generations < 1:
        raise ValueError(f"compute_advantages: num_generations = {num_generations}; must be >= 1")
    if rewards.shape[0] % num_generations:
        raise ValueError(
            f"compute_advantages: {rewards.shape[0]} rows is not a whole number of groups of {num_generations}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r, valid = total_rewards(rewards, reward_weights)
    r = torch.where(valid, r, torch.zeros_like(r))
    v = valid.to(torch.float64)

    rg, vg = r.view(-1, num_generations), v.view(-1, num_generations)
    count = vg.sum(1, keepdim=True)
    mean = (rg * vg).sum(1, keepdim=True) / count.clamp(min=1)
    adv = (rg - mean) * vg
    big = torch.finfo(torch.float64).max
    flat = (torch.where(vg > 0, rg, big).amin(1) == torch.where(vg > 0, rg, -big).amax(1)).unsqueeze(1)

    if mode == "group":
        var = (adv**2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
        adv = adv / (var.sqrt() + STD_EPS)
    elif mode == "batch":
        n = v.sum()
        bmean = (r * v).sum() / n.clamp(min=1)
        bvar = (((r - bmean) * v) ** 2).sum() / (n - 1).clamp(min=1)
        adv = adv / (bvar.sqrt() + STD_EPS)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(out_dtype)


def with_overlong_column(rewards: torch.Tensor, lengths: torch.Tensor, reward_weights, g, max_completion_length):
    """The per-function rewards [N, F] with the overlong penalty as one more column of weight 1 (so every
    statistic, per-column metrics included, sees it), and the weights to go with them. Unchanged when
    grpo.overlong_buffer_len is null."""
    if g.overlong_buffer_len is None:
        return rewards, reward_weights
    pen = torch.from_numpy(overlong_penalty(lengths.numpy(), max_completion_length, g.overlong_buffer_len,
                                            g.overlong_penalty_factor))
    weights = list(reward_weights) if reward_weights is not None else [1.0] * rewards.shape[1]
    return torch.cat([rewards.to(torch.float64), pen[:, None]], dim=1), weights + [1.0]


# ----------------------------------------------------------------------------- the loss (§4.3-4.8, §5)

_G = GRPOConfig()  # the spec's defaults, from the job schema (tandem.core): one definition

LOG_RATIO_CLAMP = 20.0  # docs/grpo.md §4.4: |log-ratio| <= 20, so exp never overflows
# the allowed values are the job schema's (one definition); pure functions still refuse others
LOSS_TYPES = typing.get_args(type(_G).model_fields["loss_type"].annotation)
TIS_MODES = typing.get_args(type(_G).model_fields["vllm_importance_sampling_mode"].annotation)


def _clean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # where(), not multiplication: 0 * inf = NaN, and where's gradient to the dropped branch is 0.
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _check(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"tandem.learner.grpo: {name} = {value!r}; allowed {', '.join(map(repr, allowed))}")


def log_ratio(logp, old_logp, mask, importance_sampling_level="token"):
    """[B, T] log importance ratio: per token, or the GSPO sequence mean broadcast to every token."""
    _check("importance_sampling_level", importance_sampling_level, ("token", "sequence"))
    m = mask.bool()
    lr = (_clean(logp, m) - _clean(old_logp, m)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if importance_sampling_level == "sequence":
        seq = (lr * m).sum(-1) / m.sum(-1).clamp(min=1)
        lr = seq.unsqueeze(-1).expand_as(lr)
    return lr


def tis_weight(old_logp, sampler_logp, mask, cap, mode="token_truncate", clip_min=None):
    """[B, T] detached truncated-importance-sampling weight from exp(old − sampler) (docs/grpo.md §4.6).
    clip_min (TRL's vllm_importance_sampling_clip_min): truncate modes raise the weight to it, mask modes
    drop weights below it as they drop those above the cap."""
    _check("tis_mode", mode, TIS_MODES)
    if cap is None or cap <= 0:
        raise ValueError(f"tandem.learner.grpo: tis_cap = {cap!r}; must be a positive number")
    m = mask.bool()
    with torch.no_grad():
        dt = torch.promote_types(old_logp.dtype, torch.float32)  # never below float32
        d = _clean(old_logp, m).to(dt) - _clean(sampler_logp, m).to(dt)
        if mode.startswith("sequence"):
            d = (d * m).sum(-1, keepdim=True).expand_as(d)
        log_min = -math.inf if clip_min is None else math.log(clip_min)
        w = truncated_is(d, math.log(cap), log_min, mode.endswith("mask"))
    return w.to(old_logp.dtype)


def k3(d):
    """The k3 estimator of KL from d = ref − logp (clamped): exp(d) − d − 1 (docs/grpo.md §4.7)."""
    return torch.exp(d) - d - 1


def k3_kl(logp, ref_logp, mask):
    """[B, T] k3 estimator exp(ref − logp) − (ref − logp) − 1 (zero where masked)."""
    m = mask.bool()
    return k3((_clean(ref_logp, m) - _clean(logp, m)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * m


def off_policy_mask(advantages, logp, sampler_logp, mask, threshold):
    """[B, 1] DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold): a completion
    leaves the loss when its advantage is negative and its mean per-token KL(sampler ‖ policy),
    mean(sampler_logp − logp), exceeds `threshold`. 1 = keep."""
    m = mask.bool()
    with torch.no_grad():
        kl = (_clean(sampler_logp, m).double() - _clean(logp.detach(), m).double()) * m
        mean_kl = kl.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        keep = (advantages.reshape(-1, 1) >= 0) | (mean_kl <= threshold)
    return keep.to(logp.dtype)


def token_term(d, advantages, *, epsilon=_G.epsilon, epsilon_high=_G.epsilon_high, delta=_G.delta, tis=None,
               beta=_G.beta, kl_d=None):
    """THE per-token GRPO term (docs/grpo.md §4.3-4.7), any shape: -min(r·A, clip(r, 1 − ε, 1 + ε_high)·A) · tis
    + β·k3(kl_d), r = exp(d), the unclipped ratio capped at delta (two-sided clipping). d: the log-ratio, clamped and
    0 where masked (log_ratio); tis: the truncated-IS weight or None; kl_d: ref − logp, clamped, when beta > 0."""
    hi = epsilon if epsilon_high is None else epsilon_high
    r = torch.exp(d)
    unclipped = r if delta is None else r.clamp(max=delta)
    loss = -torch.minimum(unclipped * advantages, r.clamp(1 - epsilon, 1 + hi) * advantages)
    if tis is not None:
        loss = loss * tis
    if beta > 0:
        loss = loss + beta * k3(kl_d)
    return loss


def grpo_token_terms(old_logp, advantages, token_weight, *, epsilon=_G.epsilon, epsilon_high=_G.epsilon_high,
                     delta=_G.delta, beta=_G.beta, ref_logp=None, tis=None, tis_from: TisFromLogp | None = None):
    """token_term over flat chunks of tokens, for kernels.linear_logprobs_loss: token_loss(logp[s:e], s, e) ->
    token_weight · token_term on tokens s..e (0 where token_weight is 0). Flat [N] inputs (tensors or scalars);
    old_logp None = on-policy (old = logp detached); tis: the truncated-IS weight, or tis_from (on-policy) to take
    it from each token's own log-prob in the pass; ref_logp when beta > 0."""
    if tis_from is not None and (old_logp is not None or tis is not None):
        raise ValueError("tandem.learner.grpo.grpo_token_terms: tis_from is the on-policy weight (old_logp None, "
                         "no tis)")
    if beta > 0 and ref_logp is None:
        raise ValueError("tandem.learner.grpo.grpo_token_terms: beta > 0 needs ref_logp")

    def col(x, s, e, like):
        return torch.as_tensor(x, dtype=like.dtype, device=like.device).expand(e - s) if not torch.is_tensor(x) \
            or x.dim() == 0 else x[s:e].to(like.dtype)

    def token_loss(logp, s, e):
        w = col(token_weight, s, e, logp)
        m = w != 0
        old = logp.detach() if old_logp is None else col(old_logp, s, e, logp)
        d = _clean(logp - old, m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        weight = col(tis, s, e, logp) if tis is not None else None
        if tis_from is not None:  # masked tokens' sampler log-probs may be garbage: weight 1 there, then 0 below
            weight = torch.where(m, tis_from.weight(logp, s, e), torch.ones_like(logp))
        kl = _clean(col(ref_logp, s, e, logp) - logp, m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if beta > 0 else None
        loss = token_term(d, col(advantages, s, e, logp), epsilon=epsilon, epsilon_high=epsilon_high, delta=delta,
                          tis=weight, beta=beta, kl_d=kl)
        return _clean(loss * w, m)

    return token_loss


def token_term_params(g) -> dict:
    """The grpo section's scalars that the per-token terms read, as the fused path's keywords (grpo_token_terms;
    kernels/triton_logprobs.py: linear_grpo_loss_triton): a new term's parameter is added here,
    not along the path between."""
    return {"epsilon": g.epsilon, "epsilon_high": g.epsilon_high, "delta": g.delta, "beta": g.beta}


def per_token_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    epsilon=_G.epsilon,
    epsilon_high=_G.epsilon_high,
    delta=_G.delta,
    importance_sampling_level=_G.importance_sampling_level,
    beta=_G.beta,
    ref_logp=None,
    sampler_logp=None,
    tis_cap=None,
    tis_mode=_G.vllm_importance_sampling_mode,
    tis_min=None,
    off_policy_threshold=None,
    behaviour_logp=None,
):
    """[B, T] clipped surrogate (+ TIS, + beta·KL); zero where mask is 0. off_policy_threshold: the
    off-policy sequence mask against behaviour_logp (the sampler's log-probs, else old_logp)."""
    m = mask.bool()
    if beta > 0 and ref_logp is None:
        raise ValueError("tandem.learner.grpo.per_token_loss: beta > 0 needs ref_logp")
    d = log_ratio(logp, old_logp, m, importance_sampling_level)
    tis = tis_weight(old_logp, sampler_logp, m, tis_cap, tis_mode, tis_min) \
        if sampler_logp is not None and tis_cap is not None else None
    kl = (_clean(ref_logp, m) - _clean(logp, m)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if beta > 0 else None
    loss = token_term(d, advantages.to(d.dtype).unsqueeze(-1), epsilon=epsilon, epsilon_high=epsilon_high,
                      delta=delta, tis=tis, beta=beta, kl_d=kl)
    if off_policy_threshold is not None:  # TRL applies it to the whole per-token loss, KL included
        behaviour = behaviour_logp if behaviour_logp is not None else old_logp
        loss = loss * off_policy_mask(advantages, logp, behaviour, m, off_policy_threshold)
    return _clean(loss, m)


def aggregate_loss(loss_per_token, mask, loss_type, *, max_completion_length=None, num_active_tokens=None):
    """Scalar loss normalised per `loss_type` (docs/grpo.md §4.8); every denominator >= 1.

    dapo: `num_active_tokens` is the active-token count of the whole optimizer step over all
    ranks; None falls back to this micro-batch's count.
    """
    _check("loss_type", loss_type, LOSS_TYPES)
    m = mask.to(loss_per_token.dtype)
    total = (loss_per_token * m).sum()
    if loss_type == "grpo":
        per_seq = (loss_per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum() / max(per_seq.numel(), 1)
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        if max_completion_length is None or max_completion_length < 1:
            raise ValueError(
                f"aggregate_loss: loss_type 'dr_grpo' needs max_completion_length >= 1, got {max_completion_length!r}"
            )
        return total / max(loss_per_token.shape[0] * max_completion_length, 1)
    n = m.sum() if num_active_tokens is None else torch.as_tensor(num_active_tokens, dtype=total.dtype)
    return total / n.clamp(min=1)


def _masked_mean(x, m):
    return float((x * m).sum() / m.sum().clamp(min=1))


@torch.no_grad()
def loss_metrics(logp, old_logp, advantages, mask, *, epsilon=_G.epsilon, epsilon_high=_G.epsilon_high,
                 importance_sampling_level=_G.importance_sampling_level, ref_logp=None, sampler_logp=None,
                 tis_cap=None, tis_mode=_G.vllm_importance_sampling_mode, tis_min=None, entropy=None, logits=None,
                 temperature=1.0) -> dict[str, float]:
    """The docs/grpo.md §5 metrics of one micro-batch as plain floats (finite even when all-masked).

    `entropy` [B, T] if the caller has it (fused kernels), else `logits` [B, T, V] to compute it.
    `tokens` is the active-token count, the weight for averaging across micro-batches and ranks.
    """
    m = mask.bool()
    mf = m.to(torch.float32)
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_ratio(logp, old_logp, m, importance_sampling_level)).float()
    a = advantages.float().unsqueeze(-1).expand_as(ratio)
    low = (ratio < 1 - epsilon) & (a < 0)
    high = (ratio > 1 + eps_hi) & (a > 0)
    out = {
        "tokens": float(mf.sum()),
        "clip_ratio/low_mean": _masked_mean(low.float(), mf),
        "clip_ratio/high_mean": _masked_mean(high.float(), mf),
        "clip_ratio/region_mean": _masked_mean((low | high).float(), mf),
    }
    if ref_logp is not None:
        out["kl"] = _masked_mean(k3_kl(logp.float(), ref_logp.float(), m), mf)
    if sampler_logp is not None and tis_cap is not None:
        w = tis_weight(old_logp.float(), sampler_logp.float(), m, tis_cap, tis_mode, tis_min)
        raw = _clean(old_logp.float(), m) - _clean(sampler_logp.float(), m)
        if tis_mode.startswith("sequence"):
            raw = (raw * m).sum(-1, keepdim=True).expand_as(raw)
        any_tok = bool(m.any())
        out["tis/weight_mean"] = _masked_mean(w, mf)
        out["tis/weight_min"] = float(w[m].min()) if any_tok else 0.0
        out["tis/weight_max"] = float(w[m].max()) if any_tok else 0.0
        out["tis/capped_frac"] = _masked_mean((raw > math.log(tis_cap)).float(), mf)
        out["tis/sampler_abs_diff_mean"] = _masked_mean(raw.abs(), mf)
    if entropy is None and logits is not None:
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        entropy = -(lp.exp() * lp).sum(-1)
    if entropy is not None:
        out["entropy"] = _masked_mean(_clean(entropy.float(), m), mf)
    return out


def token_weights(mask, loss_type, *, max_completion_length=None, num_active_tokens=None):
    """[B, T] float64 w with aggregate_loss(x) == (w * x).sum() for every per-token loss x (0 where
    masked). aggregate_loss is linear in x, so w is its gradient, taken once at any point."""
    ones = torch.ones(mask.shape, dtype=torch.float64, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        agg = aggregate_loss(ones, mask, loss_type, max_completion_length=max_completion_length,
                             num_active_tokens=num_active_tokens)
        (w,) = torch.autograd.grad(agg, ones)
    return w


@dataclass
class LossInputs:
    """One micro-batch as the loss sees it: [B, T] tensors (advantages [B]); None = not used."""

    logp: torch.Tensor  # policy log-probs (with grad when training)
    old_logp: torch.Tensor  # the behaviour policy's (logp detached when on-policy)
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 on real completion tokens
    ref_logp: torch.Tensor | None = None  # when beta > 0
    sampler_logp: torch.Tensor | None = None  # when TIS is on
    entropy: torch.Tensor | None = None  # for the metrics


def grpo_loss(x: LossInputs, g, *, tis: bool, max_completion_length: int, num_active_tokens=None, token_weight=None):
    """Scalar loss of one micro-batch (docs/grpo.md §4) from the job's `grpo` section (prime-rl's
    loss_fn(inputs, config) shape); with `token_weight` [B, T] (token_weights of the micro-batch each row belongs
    to) the weighted sum instead of the loss_type's aggregation."""
    per = per_token_loss(x.logp, x.old_logp, x.advantages, x.mask, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
                         delta=g.delta, importance_sampling_level=g.importance_sampling_level, beta=g.beta,
                         ref_logp=x.ref_logp, off_policy_threshold=g.off_policy_mask_threshold,
                         behaviour_logp=x.sampler_logp, **_tis_args(x, g, tis))
    if token_weight is not None:
        return torch.where(x.mask.bool(), per * token_weight, 0.0).sum()
    return aggregate_loss(per, x.mask, g.loss_type, max_completion_length=max_completion_length,
                          num_active_tokens=num_active_tokens)


def grpo_metrics(x: LossInputs, g, *, tis: bool) -> dict[str, float]:
    return loss_metrics(x.logp.detach(), x.old_logp, x.advantages, x.mask, epsilon=g.epsilon,
                        epsilon_high=g.epsilon_high, importance_sampling_level=g.importance_sampling_level,
                        ref_logp=x.ref_logp, entropy=x.entropy, **_tis_args(x, g, tis))


def _tis_args(x: LossInputs, g, tis: bool) -> dict:
    if not tis:
        return {}
    return {"sampler_logp": x.sampler_logp, "tis_cap": g.vllm_importance_sampling_cap,
            "tis_mode": g.vllm_importance_sampling_mode, "tis_min": g.vllm_importance_sampling_clip_min}
