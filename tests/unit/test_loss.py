"""GRPO loss vs an independent float64 implementation written from docs/grpo.md §4, loop by loop."""

import itertools
import math
import re

import pytest
import torch

from tandem.learner.grpo import aggregate_loss, loss_metrics, per_token_loss
from tests.helpers import ROOT

B, T, L_MAX = 5, 6, 8


def reference_loss(logp, old, adv, mask, samp, ref, o):
    """Scalar loss from Python loops over rows and tokens (float64 torch scalars, for autograd)."""
    eps_lo, eps_hi = o["epsilon"], o["epsilon_high"] if o["epsilon_high"] is not None else o["epsilon"]
    row_sums, row_counts = [], []
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t]]
        if o["level"] == "sequence":
            s = sum((logp[i, t] - old[i, t] for t in idx), torch.zeros((), dtype=torch.float64))
            seq_ratio = torch.exp(s / max(len(idx), 1))
        if o["tis"] and o["tis"].startswith("sequence"):
            sw = math.exp(sum(float(old[i, t] - samp[i, t]) for t in idx))
        acc = torch.zeros((), dtype=torch.float64)
        for t in idx:
            r = seq_ratio if o["level"] == "sequence" else torch.exp(logp[i, t] - old[i, t])
            r1 = torch.clamp(r, max=o["delta"]) if o["delta"] is not None else r
            r2 = torch.clamp(r, 1 - eps_lo, 1 + eps_hi)
            a = float(adv[i])
            loss = -torch.minimum(r1 * a, r2 * a)
            if o["tis"]:
                w = sw if o["tis"].startswith("sequence") else math.exp(float(old[i, t] - samp[i, t]))
                if o["tis"].endswith("truncate"):
                    w = min(w, o["cap"])
                else:
                    w = 0.0 if w > o["cap"] else w
                loss = loss * w
            if o["beta"] > 0:
                d = ref[i, t] - logp[i, t]
                loss = loss + o["beta"] * (torch.exp(d) - d - 1)
            acc = acc + loss
        row_sums.append(acc)
        row_counts.append(len(idx))
    lt = o["loss_type"]
    if lt == "grpo":
        return sum(s / max(c, 1) for s, c in zip(row_sums, row_counts)) / len(row_sums)
    total = sum(row_sums)
    if lt == "bnpo":
        return total / max(sum(row_counts), 1)
    if lt == "dr_grpo":
        return total / (len(row_sums) * L_MAX)
    return total / max(o["n_active"], 1)


def make_inputs(seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    samp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = True
    mask[1] = False  # a fully masked row
    mask[2, 0] = True
    return logp, old, adv, mask, samp, ref


GRID = list(itertools.product(
    ["grpo", "bnpo", "dr_grpo", "dapo"], ["token", "sequence"], [None, 1.5], [0.0, 0.1],
    [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"], [None, 0.28],
))


@pytest.mark.parametrize("loss_type,level,delta,beta,tis,eps_hi", GRID)
def test_grid_matches_reference(loss_type, level, delta, beta, tis, eps_hi):
    logp, old, adv, mask, samp, ref = make_inputs()
    o = dict(epsilon=0.2, epsilon_high=eps_hi, delta=delta, level=level, beta=beta, tis=tis, cap=2.0,
             loss_type=loss_type, n_active=int(mask.sum()) + 7)  # dapo: tokens of the whole step
    x = logp.clone().requires_grad_(True)
    per = per_token_loss(x, old, adv, mask, epsilon=0.2, epsilon_high=eps_hi, delta=delta,
                         importance_sampling_level=level, beta=beta, ref_logp=ref if beta else None,
                         sampler_logp=samp if tis else None, tis_cap=2.0 if tis else None,
                         tis_mode=tis or "token_truncate")
    got = aggregate_loss(per, mask, loss_type, max_completion_length=L_MAX, num_active_tokens=o["n_active"])
    (g_got,) = torch.autograd.grad(got, x)
    y = logp.clone().requires_grad_(True)
    want = reference_loss(y, old, adv, mask, samp, ref, o)
    (g_want,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-12)
    assert torch.all(per[~mask] == 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck(level):
    logp, old, adv, mask, samp, ref = make_inputs(seed=3)

    def f(x):
        per = per_token_loss(x, old, adv, mask, delta=1.5, importance_sampling_level=level, beta=0.05,
                             ref_logp=ref, sampler_logp=samp, tis_cap=2.0)
        return aggregate_loss(per, mask, "dapo")

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


def test_sequence_ratio_gradient_reaches_every_token():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = logp.detach().clone()
    mask = torch.ones(1, 3, dtype=torch.bool)
    per = per_token_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, importance_sampling_level="sequence")
    aggregate_loss(per, mask, "dapo").backward()
    # ratio exp(mean) = 1 inside the clip: d/dlogp_t of -(1/3) Σ_t ratio = -(1/3)·(1/3)·3 ... each token: -1/3
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -1 / 3, dtype=torch.float64))


def test_hand_computed_clip_and_delta():
    mask = torch.ones(1, 1, dtype=torch.bool)
    old = torch.zeros(1, 1, dtype=torch.float64)
    x = torch.full((1, 1), 0.5, dtype=torch.float64, requires_grad=True)  # ratio e^0.5 = 1.6487
    # A = +1: clipped at 1.2, no gradient
    loss = per_token_loss(x, old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert float(loss) == pytest.approx(-1.2)
    # A = -1: min(-1.6487, -1.2) = -1.6487 -> loss 1.6487; with delta=1.5 the unclipped term is capped
    loss = per_token_loss(x, old, torch.tensor([-1.0], dtype=torch.float64), mask)
    assert float(loss) == pytest.approx(math.exp(0.5))
    loss = per_token_loss(x, old, torch.tensor([-1.0], dtype=torch.float64), mask, delta=1.5)
    assert float(loss) == pytest.approx(1.5)
    # epsilon_high: A=+1, ratio 1.6487 clipped at 1.28
    loss = per_token_loss(x, old, torch.tensor([1.0], dtype=torch.float64), mask, epsilon_high=0.28)
    assert float(loss) == pytest.approx(-1.28)
    # TIS: old - samp = log 3 -> weight min(3, 2) = 2, after the min; KL not weighted
    samp = torch.full((1, 1), -math.log(3), dtype=torch.float64)
    ref = torch.zeros(1, 1, dtype=torch.float64)
    loss = per_token_loss(x, old, torch.tensor([1.0], dtype=torch.float64), mask, sampler_logp=samp, tis_cap=2.0,
                          beta=0.5, ref_logp=ref)
    kl = math.exp(-0.5) + 0.5 - 1
    assert float(loss) == pytest.approx(-1.2 * 2 + 0.5 * kl)


def test_normalisation_hand_computed():
    per = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert float(aggregate_loss(per, mask, "grpo")) == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert float(aggregate_loss(per, mask, "bnpo")) == pytest.approx(10 / 4)
    assert float(aggregate_loss(per, mask, "dr_grpo", max_completion_length=5)) == pytest.approx(10 / 10)
    assert float(aggregate_loss(per, mask, "dapo", num_active_tokens=20)) == pytest.approx(10 / 20)
    assert float(aggregate_loss(per, mask, "dapo")) == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(per, mask, "dr_grpo")
    with pytest.raises(ValueError, match="loss_type = 'ppo'"):
        aggregate_loss(per, mask, "ppo")


@pytest.mark.parametrize("garbage", [math.inf, -math.inf, math.nan, 1e9, -1e9])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_garbage_changes_nothing(garbage, level):
    logp, old, adv, mask, samp, ref = make_inputs()
    kw = dict(delta=1.5, importance_sampling_level=level, beta=0.1, tis_cap=2.0, tis_mode="sequence_truncate")

    def run(fill):
        tensors = [t.clone() for t in (logp, old, samp, ref)]
        for t in tensors:
            t[~mask] = fill
        x = tensors[0].requires_grad_(True)
        per = per_token_loss(x, tensors[1], adv, mask, ref_logp=tensors[3], sampler_logp=tensors[2], **kw)
        out = {lt: aggregate_loss(per, mask, lt, max_completion_length=L_MAX) for lt in ("grpo", "bnpo", "dapo")}
        (g,) = torch.autograd.grad(sum(out.values()), x)
        m = loss_metrics(x.detach(), tensors[1], adv, mask, ref_logp=tensors[3], sampler_logp=tensors[2],
                         tis_cap=2.0, importance_sampling_level=level, entropy=tensors[0])
        return out, g, m

    clean_out, clean_g, clean_m = run(0.0)
    dirty_out, dirty_g, dirty_m = run(garbage)
    for k in clean_out:
        assert torch.equal(clean_out[k], dirty_out[k])
    assert torch.isfinite(dirty_g).all() and torch.equal(clean_g, dirty_g)
    assert clean_m == dirty_m and all(math.isfinite(v) for v in dirty_m.values())


def test_all_masked_batch_is_zero_and_finite():
    """Every completion truncated + mask_truncated_completions: the seed's NaN case."""
    logp, old, adv, _, samp, ref = make_inputs()
    mask = torch.zeros(B, T, dtype=torch.bool)
    x = logp.clone().requires_grad_(True)
    per = per_token_loss(x, old, adv, mask, beta=0.1, ref_logp=ref, sampler_logp=samp, tis_cap=2.0)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo"):
        loss = aggregate_loss(per, mask, lt, max_completion_length=L_MAX, num_active_tokens=0)
        (g,) = torch.autograd.grad(loss, x, retain_graph=True)
        assert float(loss) == 0.0 and torch.isfinite(g).all()
    m = loss_metrics(logp, old, adv, mask, ref_logp=ref, sampler_logp=samp, tis_cap=2.0, entropy=logp)
    assert all(math.isfinite(v) for v in m.values()) and m["tokens"] == 0


def test_metrics_hand_computed():
    # 4 tokens in one row each: ratios e^0.5 (A>0 -> high), e^-0.5 (A<0 -> low), 1, 1
    logp = torch.tensor([[0.5], [-0.5], [0.0], [0.0]], dtype=torch.float64)
    old = torch.zeros(4, 1, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    samp = torch.tensor([[0.0], [-1.0], [0.0], [0.0]], dtype=torch.float64)  # weights 1, e (capped 2), 1, 1
    logits = torch.zeros(4, 1, 10)
    m = loss_metrics(logp, old, adv, mask, sampler_logp=samp, tis_cap=2.0, logits=logits, temperature=0.7)
    assert m["clip_ratio/high_mean"] == 0.25 and m["clip_ratio/low_mean"] == 0.25
    assert m["clip_ratio/region_mean"] == 0.5 and m["tokens"] == 4
    assert m["tis/weight_max"] == pytest.approx(2.0) and m["tis/weight_min"] == pytest.approx(1.0)
    assert m["tis/weight_mean"] == pytest.approx(5 / 4) and m["tis/capped_frac"] == 0.25
    assert m["entropy"] == pytest.approx(math.log(10), rel=1e-6)


def test_the_kernels_plain_defaults_are_the_job_schemas():
    """The kernels import no config; their keyword defaults are the spec's, as the job schema holds them."""
    from tandem.core.config import GRPOConfig
    from tandem.kernels import logprobs as k

    g = GRPOConfig()
    assert (k.EPSILON, k.EPSILON_HIGH, k.DELTA, k.BETA) == (g.epsilon, g.epsilon_high, g.delta, g.beta)
    src = (ROOT / "kernels").glob("*.py")
    imports = re.compile(r"^\s*(from|import) tandem\.core", re.M)
    assert not [f.name for f in src if imports.search(f.read_text())], "a kernel imports the job's config"
