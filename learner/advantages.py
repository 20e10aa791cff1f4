"""Group-relative advantages (docs/grpo.md §4.1–4.2). Pure tensors: no Ray, no DeepSpeed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core import shaping
from tandem.core.shaping import overlong_penalty

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
