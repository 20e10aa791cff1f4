"""Triton log-prob kernels against float64. On CPU through Triton's interpreter (small shapes);
on a CUDA machine the same tests compiled, plus real sizes (hidden 1536, vocab 151936).

Inputs are drawn fresh each run (the seed is printed in every failure message)."""

import pytest
import torch

from tandem.kernels import triton_logprobs as tk
from tandem.kernels.logprobs import selective_logprobs_reference
from tandem.learner.grpo import aggregate_loss, grpo_token_terms, per_token_loss, tis_weight, token_weights

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}  # max |logp - float64|
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}  # relative norm, gradients


@pytest.fixture
def seed():
    s = torch.seed() % 2**31
    torch.manual_seed(s)
    return s


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def float64_logprobs(z64, ids, temperature):
    return selective_logprobs_reference(z64, ids, temperature, with_entropy=True)  # float64 in, float64 out


SHAPES = [(37, 1, 0.7), (9, 37, 1.3), (5, tk.BLOCK_V + 5, 0.9), (3, 2 * tk.BLOCK_V, 1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,V,temp", SHAPES)
def test_selective_values_entropy_and_gradient(seed, dtype, N, V, temp):
    logits = (torch.randn(N, V, device=DEV) * 3).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (N,), device=DEV)
    up = torch.randn(N, device=DEV, dtype=torch.float64)
    logp, ent = tk.selective_logprobs_triton(logits, ids, temp, with_entropy=True)
    (logp.double() * up).sum().backward()
    z64 = logits.detach().double().requires_grad_()
    ref, ref_ent = float64_logprobs(z64, ids, temp)
    (ref * up).sum().backward()
    assert logp.dtype == ent.dtype == torch.float32
    assert (logp.double() - ref).abs().max() <= TOL[dtype], f"seed {seed}"
    assert (ent.double() - ref_ent).abs().max() <= TOL[dtype] * 10, f"seed {seed}"
    assert logits.grad.dtype == dtype
    if V == 1:  # log p = 0 whatever the logit: only rounding of exp(z - lse) = 1 is left
        assert logits.grad.abs().max() <= 1e-5, f"seed {seed}"
    else:
        assert rel(logits.grad, z64.grad) <= GRAD_TOL[dtype], f"seed {seed}"


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN row's own forward
def test_selective_masked_rows_get_zero_gradient_even_with_nan_logits(seed):
    logits = torch.randn(6, 300, device=DEV)
    logits[2] = float("nan")
    logits[4, 7] = float("inf")
    logits.requires_grad_()
    ids = torch.randint(0, 300, (6,), device=DEV)
    up = torch.tensor([1.0, -2.0, 0.0, 0.5, 0.0, 1.0], device=DEV)
    logp, _ = tk.selective_logprobs_triton(logits, ids, 0.8)
    torch.autograd.backward(logp, up)
    g = logits.grad
    assert torch.all(g[[2, 4]] == 0), f"seed {seed}"  # never read: NaN/inf there cannot leak
    assert torch.isfinite(g).all()
    z = logits.detach()[[0, 1, 3, 5]].double().requires_grad_()
    ref, _ = float64_logprobs(z, ids[[0, 1, 3, 5]], 0.8)
    torch.autograd.backward(ref, up[[0, 1, 3, 5]].double())
    assert rel(g[[0, 1, 3, 5]], z.grad) <= 1e-5, f"seed {seed}"


LINEAR = [(37, 16, 101, 8, 0.7), (23, 8, tk.BLOCK_V + 3, 16, 1.3), (4, 8, 33, 64, 1.0)]


def _linear_case(N, H, V, dtype, need_w=True):
    h = (torch.randn(N, H, device=DEV)).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device=DEV) / H**0.5 * 3).to(dtype).requires_grad_(need_w)
    ids = torch.randint(0, V, (N,), device=DEV)
    return h, w, ids


def _float64_grads(h, w, ids, temp, up):
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref, ref_ent = float64_logprobs(h64 @ w64.t(), ids, temp)
    (ref * up).sum().backward()
    return ref.detach(), ref_ent.detach(), h64.grad, w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,V,chunk,temp", LINEAR)
def test_linear_values_and_both_gradients(seed, dtype, N, H, V, chunk, temp):
    h, w, ids = _linear_case(N, H, V, dtype)
    up = torch.randn(N, device=DEV, dtype=torch.float64)
    up[::3] = 0  # masked rows
    logp, ent = tk.linear_logprobs_triton(h, w, ids, temp, chunk, with_entropy=True)
    (logp.double() * up).sum().backward()
    ref, ref_ent, gh, gw = _float64_grads(h, w, ids, temp, up)
    assert (logp.double() - ref).abs().max() <= TOL[dtype], f"seed {seed}"
    assert (ent.double() - ref_ent).abs().max() <= TOL[dtype] * 10, f"seed {seed}"
    assert h.grad.dtype == w.grad.dtype == dtype
    assert torch.all(h.grad[::3] == 0), f"seed {seed}"
    assert rel(h.grad, gh) <= GRAD_TOL[dtype] and rel(w.grad, gw) <= GRAD_TOL[dtype], f"seed {seed}"


def test_linear_frozen_head_gives_hidden_gradient_only(seed):
    h, w, ids = _linear_case(19, 8, 77, torch.float32, need_w=False)
    up = torch.randn(19, device=DEV, dtype=torch.float64)
    logp, ent = tk.linear_logprobs_triton(h, w, ids, 1.1, 5)
    assert ent is None
    (logp.double() * up).sum().backward()
    _, _, gh, _ = _float64_grads(h, w, ids, 1.1, up)
    assert w.grad is None
    assert rel(h.grad, gh) <= 1e-5, f"seed {seed}"


def test_linear_with_tied_embedding_sums_both_uses(seed):
    V, H, N = 57, 8, 13
    emb = torch.randn(V, H, device=DEV, requires_grad=True)
    x = torch.randint(0, V, (N,), device=DEV)
    ids = torch.randint(0, V, (N,), device=DEV)
    proj = torch.randn(H, H, device=DEV)

    def run(fn):
        h = torch.tanh(emb[x] @ proj)  # the "decoder": the embedding is read at the input too
        logp = fn(h, emb)
        emb.grad = None
        (logp * torch.arange(N, device=DEV)).sum().backward()
        return emb.grad.clone()

    ours = run(lambda h, e: tk.linear_logprobs_triton(h, e, ids, 0.9, 4)[0])
    ref = run(lambda h, e: float64_logprobs(h.double() @ e.double().t(), ids, 0.9)[0].float())
    assert rel(ours, ref) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_equals_plain_path_and_float64(seed, loss_type, dtype):
    B, T, H, V, chunk = 4, 9, 16, 203, 7  # chunks straddle sequences
    h, w, ids = _linear_case(B * T, H, V, dtype)
    mask = torch.rand(B, T, device=DEV) > 0.3
    adv = torch.randn(B, device=DEV)
    ref0, _ = float64_logprobs(h.detach().double() @ w.detach().double().t(), ids, 0.8)
    old = (ref0.view(B, T) + 0.3 * torch.randn(B, T, device=DEV, dtype=torch.float64)).float()
    kw = dict(epsilon=0.2, epsilon_high=0.28, beta=0.05, ref_logp=old - 0.1)
    wts = token_weights(mask, loss_type, max_completion_length=T).reshape(-1)
    token_loss = grpo_token_terms(old.reshape(-1), adv.repeat_interleave(T), wts, epsilon=0.2, epsilon_high=0.28,
                                 beta=0.05, ref_logp=kw["ref_logp"].reshape(-1))
    loss, logp, ent = tk.linear_logprobs_loss_triton(h, w, ids, token_loss, 0.8, chunk, with_entropy=True)
    loss.backward()
    gh, gw = h.grad, w.grad
    assert not logp.requires_grad and ent is not None

    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    lp64, _ = float64_logprobs(h64 @ w64.t(), ids, 0.8)
    kw64 = dict(kw, ref_logp=kw["ref_logp"].double())
    per = per_token_loss(lp64.view(B, T), old.double(), adv.double(), mask, **kw64)
    ref_loss = aggregate_loss(per, mask, loss_type, max_completion_length=T)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 + 1e-4 * abs(ref_loss.item()), f"seed {seed}"
    assert (logp.double() - lp64.detach()).abs().max() <= TOL[dtype], f"seed {seed}"
    assert rel(gh, h64.grad) <= GRAD_TOL[dtype] and rel(gw, w64.grad) <= GRAD_TOL[dtype], f"seed {seed}"


def test_fused_loss_backward_scales_with_upstream_and_frozen_head(seed):
    h, w, ids = _linear_case(10, 8, 50, torch.float32, need_w=False)
    up = torch.randn(10, device=DEV)
    loss, *_ = tk.linear_logprobs_loss_triton(h, w, ids, lambda lp, s, e: lp * up[s:e], 1.0, 4)
    (3 * loss).backward()
    _, _, gh, _ = _float64_grads(h, w, ids, 1.0, 3 * up.double())
    assert w.grad is None and rel(h.grad, gh) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("fp32_acc", [True, False])
def test_grpo_loss_backward_scales_with_upstream(seed, fp32_acc):
    """The upstream gradient is applied on the GPU, never read on the host (no sync): a scaled loss
    scales both gradients, the grad-weight buffer cast to the weight dtype on the way."""
    h, w, ids = _linear_case(21, 8, 60, torch.bfloat16)
    adv, wt = torch.randn(21, device=DEV), torch.rand(21, device=DEV)
    grads = []
    for scale in (1.0, 0.37):
        h.grad = w.grad = None
        loss, *_ = tk.linear_grpo_loss_triton(h, w, ids, None, adv, wt, chunk=8, grad_weight_fp32=fp32_acc)
        (scale * loss).backward()
        grads.append((h.grad, w.grad))
    (gh1, gw1), (gh, gw) = grads
    assert gh.dtype == gw.dtype == torch.bfloat16
    # two independent bf16 roundings (2^-8 each where Triton's interpreter truncates); a scale not
    # applied is off by 170%
    assert rel(gh, 0.37 * gh1.double()) <= 1e-2 and rel(gw, 0.37 * gw1.double()) <= 1e-2, f"seed {seed}"


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
def test_first_chunk_overwrites_an_uninitialised_grad_weight_buffer(acc_dtype):
    """linear_grpo_loss allocates the grad-weight buffer without a memset: its first chunk writes it
    (beta 0, whatever was there, NaN included), later chunks add."""
    d, h = torch.randn(9, 30, device=DEV).bfloat16(), torch.randn(9, 8, device=DEV).bfloat16()
    acc = torch.full((30, 8), float("nan"), dtype=acc_dtype, device=DEV)
    tk._add_grad_weight(acc, d, h, 0.0)
    prod = d.double().t() @ h.double()
    assert rel(acc, prod) <= (1e-6 if acc_dtype == torch.float32 else 4e-3)
    tk._add_grad_weight(acc, d, h)
    assert rel(acc, 2 * prod) <= (1e-6 if acc_dtype == torch.float32 else 4e-3)


def test_auto_chunk_splits_rows_evenly_within_the_memory_budget():
    GiB = 2**30
    for V, H, trains, fp32 in [(151936, 1536, False, True), (151936, 1536, True, True), (152064, 3584, True, True),
                               (151936, 1536, True, False), (50000, 64, False, True)]:
        gw = V * H * (4 if fp32 else 2) if trains else 0
        cast = V * H * 2 if trains and fp32 else 0
        budget = max(0.55 * GiB, 1.35 * GiB - gw, cast)
        for lb in (4, 2):  # float32 logits, or _logits_tiles' float16 e
            most = int(budget // (lb * V)) // 128 * 128
            for rows in (1, 127, 1000, 4096, 16384, 16385, 32768):
                c = tk.auto_chunk(V, rows, gw, cast, lb)
                assert c % 128 == 0 and c * lb * V <= budget, (V, H, rows, c)
                assert -(-rows // c) == -(-rows // most), (V, H, rows, c)  # no more chunks than the budget needs
    assert tk.auto_chunk(151936, 16384) == 2048  # 8 equal chunks, not 7 of 2304 and a tail of 256
    assert tk.auto_chunk(151936, 16384, logit_bytes=2) == 4096


def test_bad_temperature_and_row_mismatch_are_named():
    h, w, ids = _linear_case(4, 8, 20, torch.float32)
    with pytest.raises(ValueError, match="linear_logprobs: temperature = 0"):
        tk.linear_logprobs_triton(h, w, ids, 0)
    with pytest.raises(ValueError, match="3 token ids for 4 rows"):
        tk.selective_logprobs_triton(h @ w.t(), ids[:3])
    with pytest.raises(ValueError, match="linear_grpo_loss: chunk = 0; allowed"):
        tk.linear_grpo_loss_triton(h, w, ids, None, 1.0, 1.0, chunk=0)
    with pytest.raises(ValueError, match="linear_grpo_loss: advantages has shape \\(3,\\); needs \\(4,\\)"):
        tk.linear_grpo_loss_triton(h, w, ids, None, torch.ones(3), 1.0)


@pytest.mark.skipif(not CUDA, reason="real sizes need the GPU (run on the device machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_real_size_qwen_1_5b_head(seed, dtype):
    N, H, V = 4096, 1536, 151936
    h = torch.randn(N, H, device=DEV).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device=DEV) * 0.02).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (N,), device=DEV)
    up = torch.randn(N, device=DEV, dtype=torch.float64)
    logp, ent = tk.linear_logprobs_triton(h, w, ids, 0.7, 1024, with_entropy=True)
    (logp.double() * up).sum().backward()
    ref, ref_ent, gh, gw = _float64_grads(h, w, ids, 0.7, up)
    err = (logp.double() - ref).abs().max().item()
    print(f"\nreal size {dtype}: max|logp-f64| {err:.2e} max|ent-f64| {(ent.double() - ref_ent).abs().max():.2e} "
          f"grad_hidden rel {rel(h.grad, gh):.2e} grad_weight rel {rel(w.grad, gw):.2e}")
    assert err <= TOL[dtype], f"seed {seed}"
    assert rel(h.grad, gh) <= GRAD_TOL[dtype] and rel(w.grad, gw) <= GRAD_TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [
    dict(loss_type="dapo"),
    dict(loss_type="dapo", grad_weight_fp32=False),
    dict(loss_type="grpo", epsilon_high=0.28, delta=1.5),
    dict(loss_type="dr_grpo", beta=0.1, tis=True),
    dict(loss_type="bnpo", epsilon=0.1, beta=0.04, delta=2.0, tis=True),
])
def test_in_kernel_grpo_loss_equals_autograd_of_per_token_loss(seed, dtype, opts, epilogue):
    """linear_grpo_loss (GRPO derivative computed in the kernel) == autograd through per_token_loss
    and aggregate_loss in float64, with clipping on both sides, delta, KL, TIS and masked garbage.
    epilogue: the log-sum-exp from the logits matmul's tile statistics (bf16; float32 falls back to
    cuBLAS), 33 rows in chunks of 8 under one 128-row tile, vocab 296 = one whole 256-wide tile + part."""
    B, T, H, V = 3, 11, 16, 296
    opts = dict(opts, lse_epilogue=epilogue)
    loss_type, use_tis = opts.pop("loss_type"), opts.pop("tis", False)
    h, w, ids = _linear_case(B * T, H, V, dtype)
    ids[:5] = torch.tensor([0, 127, 255, 256, V - 1])  # chosen logits at tile and half-tile edges
    assert tk.tile_stats_ok(h, w) == (dtype == torch.bfloat16)
    mask = torch.rand(B, T, device=DEV) > 0.25
    adv = torch.randn(B, device=DEV)
    lp0, _ = float64_logprobs(h.detach().double() @ w.detach().double().t(), ids, 0.9)
    old = lp0.view(B, T) + 0.4 * torch.randn(B, T, device=DEV, dtype=torch.float64)  # ratios well outside 1 +- eps
    old = old.masked_fill(~mask, float("nan")).float()  # garbage where masked must not leak
    kw = {k: v for k, v in opts.items() if k not in ("grad_weight_fp32", "lse_epilogue")}
    if kw.get("beta", 0) > 0:
        kw["ref_logp"] = (old - 0.2 * torch.rand(B, T, device=DEV)).float()
    if use_tis:
        sampler = old + 0.3 * torch.randn(B, T, device=DEV)
        kw.update(sampler_logp=sampler, tis_cap=1.3)
    wts = token_weights(mask, loss_type, max_completion_length=T)
    tis = tis_weight(old, sampler, mask, 1.3) if use_tis else None
    loss, logp, ent = tk.linear_grpo_loss_triton(
        h, w, ids, old.reshape(-1), adv.repeat_interleave(T), wts.reshape(-1), temperature=0.9,
        tis=None if tis is None else tis.reshape(-1),
        ref_logp=kw["ref_logp"].reshape(-1) if "ref_logp" in kw else None, chunk=8, with_entropy=True,
        **{k: v for k, v in opts.items() if k in ("epsilon", "epsilon_high", "delta", "beta", "grad_weight_fp32",
                                                  "lse_epilogue")})
    loss.backward()

    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    lp64, ent64 = float64_logprobs(h64 @ w64.t(), ids, 0.9)
    kw64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw.items()}
    per = per_token_loss(lp64.view(B, T), old.double(), adv.double(), mask, **kw64)
    ref_loss = aggregate_loss(per, mask, loss_type, max_completion_length=T)
    ref_loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 + 1e-4 * abs(ref_loss.item()), f"seed {seed}"
    assert (logp.double() - lp64.detach()).abs().max() <= TOL[dtype], f"seed {seed}"
    assert (ent.double() - ent64.detach()).abs().max() <= TOL[dtype] * 10, f"seed {seed}"
    assert rel(h.grad, h64.grad) <= GRAD_TOL[dtype] and rel(w.grad, w64.grad) <= GRAD_TOL[dtype], f"seed {seed}"


@pytest.mark.skipif(not CUDA, reason="real sizes need the GPU (run on the device machine)")
@pytest.mark.parametrize("epilogue", [False, True])
def test_real_size_in_kernel_grpo_loss(seed, epilogue):
    B, T, H, V = 4, 1024, 1536, 151936
    h = torch.randn(B * T, H, device=DEV).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=DEV) * 0.02).bfloat16().requires_grad_()
    ids = torch.randint(0, V, (B * T,), device=DEV)
    mask = torch.rand(B, T, device=DEV) > 0.2
    adv = torch.randn(B, device=DEV)
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    lp64, _ = float64_logprobs(h64 @ w64.t(), ids, 0.7)
    old = (lp64.detach().view(B, T) + 0.3 * torch.randn(B, T, device=DEV, dtype=torch.float64)).float()
    loss, logp, _ = tk.linear_grpo_loss_triton(h, w, ids, old.reshape(-1), adv.repeat_interleave(T),
                                               token_weights(mask, "dapo").reshape(-1), temperature=0.7,
                                               epsilon_high=0.28, lse_epilogue=epilogue)
    loss.backward()
    ref = aggregate_loss(per_token_loss(lp64.view(B, T), old.double(), adv.double(), mask, epsilon_high=0.28),
                         mask, "dapo")
    ref.backward()
    print(f"\nreal size grpo (lse epilogue {epilogue and tk.tile_stats_ok(h, w)}): "
          f"loss {loss.item():.6f} vs {ref.item():.6f}, max|logp-f64| "
          f"{(logp.double() - lp64.detach()).abs().max():.2e}, grad_hidden rel {rel(h.grad, h64.grad):.2e}, "
          f"grad_weight rel {rel(w.grad, w64.grad):.2e}")
    assert abs(loss.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item())), f"seed {seed}"
    assert (logp.double() - lp64.detach()).abs().max() <= TOL[torch.bfloat16], f"seed {seed}"
    assert rel(h.grad, h64.grad) <= GRAD_TOL[torch.bfloat16] and rel(w.grad, w64.grad) <= GRAD_TOL[torch.bfloat16]


def test_in_kernel_on_policy_equals_reference_path(seed):
    """old_logp=None (ratio 1, TRL's single-iteration case) with TIS and KL: the kernel against the
    PyTorch reference path (kernels.logprobs.linear_logprobs_loss_reference + learner.grpo.grpo_token_terms)."""
    from tandem.kernels.logprobs import linear_logprobs_loss_reference

    N, H, V = 29, 16, 90
    h, w, ids = _linear_case(N, H, V, torch.float32)
    adv, wt = torch.randn(N, device=DEV), torch.rand(N, device=DEV) * (torch.rand(N, device=DEV) > 0.2)
    tis, ref = torch.rand(N, device=DEV) + 0.5, torch.randn(N, device=DEV) - 4
    kw = dict(epsilon=0.2, beta=0.07, ref_logp=ref, tis=tis)
    loss, logp, _ = tk.linear_grpo_loss_triton(h, w, ids, None, adv, wt, temperature=1.2, chunk=8, **kw)
    loss.backward()
    gh, gw = h.grad, w.grad
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_loss, ref_lp, _ = linear_logprobs_loss_reference(h64, w64, ids, grpo_token_terms(None, adv, wt, **kw), 1.2, 8)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1, abs(ref_loss.item())), f"seed {seed}"
    assert rel(gh, h64.grad) <= 1e-5 and rel(gw, w64.grad) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,clip_min", [("token_truncate", None), ("token_truncate", 0.8), ("token_mask", 0.8)])
def test_in_kernel_tis_from_logp_equals_the_weight_taken_first(seed, dtype, mode, clip_min):
    """On-policy TIS with the weight taken inside the loss's pass (tis_from, no lm_head pass before it) gives the
    loss, log-probs and gradients of the same kernel handed learner.grpo.tis_weight of those log-probs; the
    PyTorch reference path the same. Masked tokens carry NaN sampler log-probs; tokens fall on both sides of the
    cap (1.3) and of clip_min."""
    from tandem.kernels.logprobs import TisFromLogp, linear_logprobs_loss_reference

    B, T, H, V = 3, 11, 16, 296
    h, w, ids = _linear_case(B * T, H, V, dtype)
    mask = torch.rand(B, T, device=DEV) > 0.25
    mask[0, :2] = True
    adv = torch.randn(B, device=DEV).repeat_interleave(T)
    wts = token_weights(mask, "dapo").reshape(-1)
    with torch.no_grad():
        lp, _ = tk.linear_logprobs_triton(h.detach(), w.detach(), ids, 0.9)
    noise = 0.4 * torch.randn(B, T, device=DEV)
    noise[0, 0], noise[0, 1] = 1.0, -1.0  # a token past each bound whatever the seed draws
    sampler = (lp.view(B, T) + noise).masked_fill(~mask, float("nan"))
    tis = tis_weight(lp.view(B, T), sampler, mask, 1.3, mode, clip_min).reshape(-1)
    d = (lp.view(B, T) - sampler)[mask]
    assert (d > 0.3).any() and (d < -0.3).any(), f"seed {seed}: no token beyond the bounds"
    kw = dict(temperature=0.9, chunk=8, with_entropy=True)
    runs = []
    for extra in (dict(tis=tis), dict(tis_from=TisFromLogp(sampler.reshape(-1), 1.3, clip_min, mode))):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss, logp, _ = tk.linear_grpo_loss_triton(hh, ww, ids, None, adv, wts, **kw, **extra)
        loss.backward()
        runs.append((loss, logp, hh.grad, ww.grad))
    (l1, p1, gh1, gw1), (l2, p2, gh2, gw2) = runs
    assert torch.isfinite(l2) and torch.isfinite(gh2).all() and torch.isfinite(gw2).all()
    assert abs(l1.item() - l2.item()) <= 1e-5 * max(1.0, abs(l1.item())), f"seed {seed}"
    # in bf16 the two weights (torch.exp here, the kernel's exp there) may differ in float32's last bit, and a
    # dL/dlogits element then rounds to bf16 one step (2**-7 of it) apart: on one H100, rel(gw) 1.2e-5 for a seed
    # (bench/results/e2e_gpu_scale_raw/h100/2026-12-06-d82b51a/1.5b_longtail/cuda_tests.txt); float32 stays at 1e-5
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.equal(p1, p2) and rel(gh2, gh1) <= tol and rel(gw2, gw1) <= tol, f"seed {seed}"
    # the reference path: float64, its own log-probs; tokens at a bound's edge may fall either way, so no mask mode
    if mode == "token_truncate":
        h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        terms = grpo_token_terms(None, adv.double(), wts.double(),
                                 tis_from=TisFromLogp(sampler.reshape(-1).double(), 1.3, clip_min, mode))
        ref, _, _ = linear_logprobs_loss_reference(h64, w64, ids, terms, temperature=0.9, chunk=8)
        ref.backward()
        assert abs(ref.item() - l2.item()) <= 1e-4 * max(1.0, abs(ref.item())) + (0 if dtype == torch.float32
                                                                                     else 2e-3), f"seed {seed}"
        assert rel(gh2, h64.grad) <= GRAD_TOL[dtype], f"seed {seed}"


def test_tis_from_logp_is_refused_beside_old_logp_or_a_weight_and_outside_token_modes():
    from tandem.kernels.logprobs import TisFromLogp

    h, w, ids = _linear_case(4, 16, 32, torch.float32)
    t = TisFromLogp(torch.zeros(4, device=DEV), 2.0)
    with pytest.raises(ValueError, match="on-policy"):
        tk.linear_grpo_loss_triton(h, w, ids, torch.zeros(4, device=DEV), 1.0, 1.0, tis_from=t)
    with pytest.raises(ValueError, match="on-policy"):
        grpo_token_terms(None, 1.0, 1.0, tis=torch.ones(4), tis_from=t)
    with pytest.raises(ValueError, match="sequence_mask.*allowed: token_truncate, token_mask"):
        TisFromLogp(torch.zeros(4), 2.0, mode="sequence_mask")
