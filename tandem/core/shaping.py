"""Reward shaping and group filtering shared by the rollout worker (which flags groups) and the learner
(which trains on them): numpy, float64, one definition each."""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, max_completion_length: int, buffer_len: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment (verl's overlong_buffer; TRL's get_soft_overlong_punishment at
    factor 1): 0 up to max_completion_length − buffer_len tokens, then falling linearly to −factor at
    max_completion_length (and below, for anything longer). lengths [N] -> float64 [N]."""
    if not 0 < buffer_len <= max_completion_length:
        raise ValueError(f"overlong_penalty: buffer_len = {buffer_len}; allowed 1..max_completion_length "
                         f"({max_completion_length})")
    over = np.asarray(lengths, dtype=np.float64) - (max_completion_length - buffer_len)
    return np.minimum(-over / buffer_len * factor, 0.0)


def total_rewards(rewards, reward_weights=None) -> tuple[np.ndarray, np.ndarray]:
    """The reward of a completion, the one definition (training's advantages, dynamic sampling's filter and the
    evaluation use it): [N, F] per-function rewards (NaN = the function returned None) -> (the weighted sum of
    the functions' rewards, None counting 0, float64 [N]; valid [N]: some function scored it). TRL's
    GRPOTrainer: nansum(rewards_per_func * reward_weights)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim == 1:
        r = r[:, None]
    w = np.ones(r.shape[1]) if reward_weights is None else np.asarray(reward_weights, dtype=np.float64)
    if w.shape != (r.shape[1],):
        raise ValueError(f"total_rewards: {len(w)} reward_weights for {r.shape[1]} reward columns")
    return np.nansum(r * w, axis=1), ~np.isnan(r).all(axis=1)


def group_total_rewards(rewards, reward_weights=None, penalty=None) -> np.ndarray:
    """[G, F] per-function rewards (NaN = None) -> the total of each completion that some function scored
    (+ the overlong penalty), float64 — what advantages are computed from."""
    total, valid = total_rewards(rewards, reward_weights)
    total = total + (0.0 if penalty is None else np.asarray(penalty, dtype=np.float64))
    return total[valid]


def is_informative(rewards, reward_weights=None, penalty=None) -> bool:
    """DAPO's dynamic-sampling filter: a group teaches something only if its completions' rewards differ
    (equal rewards give every completion advantage 0)."""
    t = group_total_rewards(rewards, reward_weights, penalty)
    return len(t) > 1 and float(t.max() - t.min()) > 0.0
