"""model.max_tokens_per_forward: the plan's micro-batches regrouped into forwards of at most a token budget. The
bins against their promises, and the per-row weights against each loss_type's normalisation written out by hand."""

import random

import pytest
import torch

from tandem.learner.forwards import plan_weights, token_budget_bins, weights_tensor


@pytest.mark.parametrize("seed", range(20))
def test_bins_hold_every_row_once_within_the_budget_and_as_many_on_every_rank(seed):
    rng = random.Random(seed)
    ranks = rng.randint(1, 3)
    rows, start, n = [], 0, rng.randint(4, 12)  # as many rows on every rank (the plan's)
    for _ in range(ranks):
        rows.append([(start + i, rng.choice([rng.randint(1, 40), rng.randint(100, 300)])) for i in range(n)])
        start += n
    budget = rng.choice([1, 50, 128, 300, 1000])
    bins = token_budget_bins(rows, budget)
    assert len({len(b) for b in bins}) == 1  # every rank runs as many backward passes
    for rank_rows, rank_bins in zip(rows, bins):
        tokens = dict(rank_rows)
        assert sorted(r for b in rank_bins for r in b) == sorted(tokens)  # each row once, on its own rank
        for b in rank_bins:
            assert b, "an empty forward"
            assert len(b) == 1 or sum(tokens[r] for r in b) <= budget
    # the rank that needs the most forwards gets no more than twice the fewest its tokens allow (first-fit)
    need = max(max(-(-sum(n for _, n in r) // budget), sum(n > budget for _, n in r)) for r in rows)
    assert len(bins[0]) <= 2 * need


def test_a_rank_needing_fewer_forwards_splits_its_fullest():
    # rank 0: three rows of 100 at budget 100 -> 3 forwards; rank 1: four rows of 10 fit one, split to three
    bins = token_budget_bins([[(0, 100), (1, 100), (2, 100)], [(3, 10), (4, 10), (5, 10), (6, 10)]], 100)
    assert [len(b) for b in bins] == [3, 3]
    assert sorted(len(b) for b in bins[1]) == [1, 1, 2]
    with pytest.raises(ValueError, match="budget 0"):
        token_budget_bins([[(0, 5)]], 0)


def _hand_loss(x, mask, loss_type, Tmax, n_active):
    """docs/grpo.md §4.8 on one micro-batch, per loss_type, written out."""
    m = mask.float()
    per_row = (x * m).sum(-1)
    if loss_type == "grpo":
        return (per_row / m.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return per_row.sum() / m.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return per_row.sum() / (x.shape[0] * Tmax)
    return per_row.sum() / n_active  # dapo


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_row_weights_regrouped_give_each_micro_batch_its_own_normalisation(loss_type):
    g = torch.Generator().manual_seed(3)
    lengths = [[5, 1, 9], [3, 7, 2], [4, 4, 8]]  # three plan micro-batches of three rows
    masks, xs = [], []
    for lens in lengths:
        T = max(lens)
        mask = torch.zeros(len(lens), T, dtype=torch.bool)
        for b, n in enumerate(lens):
            mask[b, :n] = torch.rand(n, generator=g) < 0.8  # a tool's tokens: masked inside the completion
        masks.append(mask)
        xs.append(torch.randn(len(lens), T, generator=g, dtype=torch.float64))
    n_active = int(sum(m.sum() for m in masks))
    want = sum(_hand_loss(x, m, loss_type, 16, n_active) for x, m in zip(xs, masks))
    w = plan_weights(masks, lengths, loss_type, max_completion_length=16, num_active_tokens=n_active)
    # regroup: every row alone, in another order, its weights as one [B, T] tensor
    rows = [(k, b) for k in range(3) for b in range(3)][::-1]
    W = weights_tensor([w[k][b] for k, b in rows], 9)
    X = torch.zeros(len(rows), 9, dtype=torch.float64)
    for i, (k, b) in enumerate(rows):
        X[i, :lengths[k][b]] = xs[k][b, :lengths[k][b]]
    got = (W.double() * X).sum()
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=1e-7)
