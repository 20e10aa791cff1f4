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


def group_total_rewards(rewards, reward_weights=None, penalty=None) -> np.ndarray:
    """[G, F] per-function rewards (NaN = None) -> the weighted total of each completion that some
    function scored (+ the overlong penalty), float64 — what advantages are computed from."""
    r = np.asarray(rewards, dtype=np.float64)
    w = np.ones(r.shape[1]) if reward_weights is None else np.asarray(reward_weights, dtype=np.float64)
    valid = ~np.isnan(r).all(axis=1)
    total = np.nansum(r * w, axis=1) + (0.0 if penalty is None else np.asarray(penalty, dtype=np.float64))
    return total[valid]


def is_informative(rewards, reward_weights=None, penalty=None) -> bool:
    """DAPO's dynamic-sampling filter: a group teaches something only if its completions' rewards differ
    (equal rewards give every completion advantage 0)."""
    t = group_total_rewards(rewards, reward_weights, penalty)
    return len(t) > 1 and float(t.max() - t.min()) > 0.0
