"""Advantages against a plain-Python float64 reference and hand-computed cases."""

import itertools
import math
import random

import pytest
import torch

from tandem.learner.grpo import compute_advantages


def reference(rows, G, weights, scale):
    """rows: list of lists (None = function returned None). Plain Python, float64."""
    F = len(rows[0])
    w = weights or [1.0] * F
    tot = [None if all(v is None for v in r) else sum(wk * v for wk, v in zip(w, r) if v is not None) for r in rows]
    valid_all = [t for t in tot if t is not None]

    def std(xs):
        if len(xs) < 2:
            return 0.0
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    out = []
    for g in range(len(rows) // G):
        grp = tot[g * G:(g + 1) * G]
        vals = [t for t in grp if t is not None]
        mean = sum(vals) / len(vals) if vals else 0.0
        flat = len(set(vals)) <= 1
        for t in grp:
            if t is None or flat:
                out.append(0.0)
                continue
            a = t - mean
            if scale == "group":
                a /= std(vals) + 1e-4
            elif scale == "batch":
                a /= std(valid_all) + 1e-4
            out.append(a)
    return out


def random_rows(rng, n, F, p_none):
    return [[None if rng.random() < p_none else rng.choice([rng.uniform(-2, 3), float(rng.randint(0, 1))])
             for _ in range(F)] for _ in range(n)]


@pytest.mark.parametrize("scale,G,F,weights", [
    (s, g, f, w) for s, g, (f, w) in itertools.product(
        ["group", "batch", "none", True, False], [2, 3, 8], [(1, None), (2, [1.0, 0.5]), (3, [2.0, -1.0, 0.25])])
])
def test_matches_reference(scale, G, F, weights):
    rng = random.Random()  # fresh inputs each run
    rows = random_rows(rng, 4 * G, F, p_none=0.2)
    rows[0] = [None] * F  # a row every function skipped
    t = torch.tensor([[math.nan if v is None else v for v in r] for r in rows], dtype=torch.float32)
    got = compute_advantages(t, G, weights, scale)
    mode = {True: "group", False: "none"}.get(scale, scale)
    want = reference([[None if v is None else float(torch.tensor(v, dtype=torch.float32)) for v in r] for r in rows],
                     G, weights, mode)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_hand_computed():
    r = torch.tensor([[1.0], [2.0], [3.0], [5.0], [5.0], [5.0]])
    a = compute_advantages(r, 3)
    assert a.tolist() == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0, 0.0], abs=1e-7)
    # batch: group means 2 and 5; batch std of [1,2,3,5,5,5] = sqrt(17.5/5... ) computed by hand:
    # mean 3.5, squares 6.25+2.25+0.25+2.25*3 = 15.5, /5 = 3.1
    b = compute_advantages(r, 3, scale_rewards="batch")
    s = math.sqrt(3.1) + 1e-4
    assert b.tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0, 0.0, 0.0], abs=1e-6)
    n = compute_advantages(r, 3, scale_rewards=False)
    assert n.tolist() == pytest.approx([-1, 0, 1, 0, 0, 0], abs=1e-7)


def test_none_rows_and_partial_nansum():
    nan = math.nan
    # row 1: every function None -> 0 and out of the stats; row 2: partial -> sum of the rest
    r = torch.tensor([[1.0, 1.0], [nan, nan], [nan, 4.0], [0.0, 0.0]])
    a = compute_advantages(r, 4, scale_rewards="none")
    mean = (2.0 + 4.0 + 0.0) / 3
    assert a.tolist() == pytest.approx([2 - mean, 0.0, 4 - mean, 0 - mean], abs=1e-6)


def test_zero_std_group_is_zero_not_nan():
    r = torch.full((8, 1), 0.1)
    for s in ("group", "batch", "none"):
        a = compute_advantages(r, 4, scale_rewards=s)
        assert torch.equal(a, torch.zeros(8))
    allnan = torch.full((4, 2), math.nan)
    assert torch.equal(compute_advantages(allnan, 4), torch.zeros(4))


def test_bad_arguments_named():
    with pytest.raises(ValueError, match="scale_rewards = 'mean'"):
        compute_advantages(torch.zeros(4, 1), 2, scale_rewards="mean")
    with pytest.raises(ValueError, match="5 rows"):
        compute_advantages(torch.zeros(5, 1), 2)
    with pytest.raises(ValueError, match="reward_weights"):
        compute_advantages(torch.zeros(4, 2), 2, reward_weights=[1.0])


def test_overlong_penalty_is_dapos_formula_in_float64():
    from tandem.core.shaping import overlong_penalty

    L, buf, k = 20, 8, 0.5
    lengths = torch.arange(0, 26)
    got = torch.from_numpy(overlong_penalty(lengths.numpy(), L, buf, k))
    want = torch.tensor([0.0 if n <= L - buf else -k * (n - (L - buf)) / buf for n in range(26)],
                        dtype=torch.float64)  # verl: min(-(n - expected) / buffer * factor, 0)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert got[L] == -k and got[L - buf] == 0 and got[L - buf + 1] < 0
    with pytest.raises(ValueError, match="buffer_len = 0"):
        overlong_penalty(lengths, L, 0)


def test_overlong_column_joins_the_rewards_with_weight_one():
    from types import SimpleNamespace

    from tandem.learner.grpo import compute_advantages, total_rewards, with_overlong_column

    r = torch.tensor([[1.0], [1.0], [1.0], [1.0]])
    lengths = torch.tensor([4, 10, 4, 10])
    g = SimpleNamespace(overlong_buffer_len=4, overlong_penalty_factor=1.0)
    ext, w = with_overlong_column(r, lengths, [2.0], g, max_completion_length=10)
    assert w == [2.0, 1.0] and torch.equal(ext[:, 1], torch.tensor([0.0, -1.0, 0.0, -1.0], dtype=torch.float64))
    assert torch.equal(total_rewards(ext, w)[0], torch.tensor([2.0, 1.0, 2.0, 1.0], dtype=torch.float64))
    adv = compute_advantages(ext, 2, w, "none")
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=torch.float64))  # long ones lose
    same, w0 = with_overlong_column(r, lengths, None, SimpleNamespace(overlong_buffer_len=None), 10)
    assert same is r and w0 is None
