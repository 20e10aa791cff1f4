"""The forwards an optimizer step runs: the batch plan's micro-batches, or (a packed learner with
`model.max_tokens_per_forward`) their sequences regrouped into forwards of at most that many tokens.

The loss stays the plan's: each sequence's per-token weights are taken on the micro-batch the plan puts it in
(`token_weights`: grpo's per-sequence means, bnpo's micro-batch token count, dr_grpo's constant, dapo's step count),
and the step's objective is the weighted sum over its tokens however they are grouped, so every grouping gives
the same loss and gradient (verl's dynamic batch size, `use_dynamic_bsz` with `ppo_max_token_len_per_gpu`,
does the same for its token-mean losses). Pure functions on lengths and masks; learner/actor.py runs them."""

from __future__ import annotations

import torch

from tandem.learner.grpo import token_weights


def token_budget_bins(lengths: list[list[tuple[int, int]]], budget: int) -> list[list[list[int]]]:
    """Every rank's (row, tokens) pairs (as many rows on every rank, as the plan gives them) -> per rank, the same
    number of forwards, each a list of rows with at most `budget` tokens (a longer row alone). First-fit decreasing
    per rank; ranks that need fewer forwards split their fullest ones, since every rank must run as many backward
    passes as the others (ZeRO's collectives)."""
    if budget < 1:
        raise ValueError(f"token_budget_bins: budget {budget}; allowed: >= 1 token")
    per_rank = [_first_fit_decreasing(rows, budget) for rows in lengths]
    n = max(len(b) for b in per_rank)
    return [_split_to(bins, n, dict(rows)) for bins, rows in zip(per_rank, lengths)]


def _first_fit_decreasing(rows: list[tuple[int, int]], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for row, n in sorted(rows, key=lambda x: (-x[1], x[0])):
        for i, r in enumerate(room):
            if n <= r:
                bins[i].append(row)
                room[i] -= n
                break
        else:
            bins.append([row])
            room.append(budget - n)
    return bins


def _split_to(bins: list[list[int]], n: int, tokens: dict[int, int]) -> list[list[int]]:
    """Split the fullest bin of two or more rows in two (alternate rows by size) until there are n."""
    bins = [list(b) for b in bins]
    while len(bins) < n:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise ValueError(f"token_budget_bins: {sum(map(len, bins))} rows cannot fill {n} forwards")
        b = max(splittable, key=lambda x: sum(tokens[r] for r in x))
        bins.remove(b)
        b = sorted(b, key=lambda r: -tokens[r])
        bins += [b[0::2], b[1::2]]
    return sorted(bins, key=lambda b: -sum(tokens[r] for r in b))


def plan_weights(masks: list[torch.Tensor], lengths: list[list[int]], loss_type: str, *, max_completion_length: int,
                 num_active_tokens: int | None) -> list[list[torch.Tensor]]:
    """Per plan micro-batch (its [B, T] loss mask and its rows' completion lengths), each row's per-token loss
    weights over its own completion tokens, as `token_weights` gives them on that micro-batch."""
    out = []
    for mask, lens in zip(masks, lengths):
        w = token_weights(mask, loss_type, max_completion_length=max_completion_length,
                          num_active_tokens=num_active_tokens).float()
        out.append([w[b, :n] for b, n in enumerate(lens)])
    return out


def weights_tensor(row_weights: list[torch.Tensor], T: int) -> torch.Tensor:
    """Rows' weight vectors as one [B, T] tensor, 0 past each completion."""
    w = torch.zeros((len(row_weights), T), dtype=torch.float32)
    for b, x in enumerate(row_weights):
        w[b, :len(x)] = x
    return w
