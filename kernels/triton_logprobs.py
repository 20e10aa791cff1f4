"""Triton log-probs of chosen tokens: online log-sum-exp over vocabulary blocks, float32 inside.

Row kernels (one program per row, vocabulary walked in blocks, nothing [rows, vocab] kept):
  _row_stats:  logits -> lse, logp of the chosen token, entropy (one read of the row)
  _row_grad:   logits, lse, dL/dlogp -> dL/dlogits = g/T * (onehot - softmax), written in place
  _row_grpo:   both, with the GRPO loss and its derivative computed in between (one launch)
  _logits_tiles: the logits matmul (persistent, TMA) keeping per-tile max / sum exp, the chosen logit
               and float16 exp(logit - tile max) in its epilogue (2 bytes a logit, not 4)
  _tiles_grpo: _row_grpo after _logits_tiles: log-sum-exp from the tile statistics, one read of e

Entry points (the PyTorch references live in `logprobs.py` and `learner/grpo.py`):
  selective_logprobs_triton    logits exist; backward from the saved lse (no softmax stored)
  linear_logprobs_triton       hidden @ lm_head.T a chunk of rows at a time; backward recomputes a chunk
  linear_logprobs_loss_triton  any loss that is a sum of per-token terms (a PyTorch function): each
                               chunk's gradients are formed right after its forward, logits computed once
  linear_grpo_loss_triton      the same for the GRPO loss, its derivative in the row kernel

The chunk's logits are float32 (cuBLAS accumulates in float32 and writes float32), so log-probs
carry no bf16 rounding of the logits; dL/dlogits is then written in the weight's dtype over the
front half of each float32 row (_front_view), so a chunk costs 4 bytes per logit, once.
_logits_tiles (bf16/fp16 on Hopper) keeps only what the GRPO gradient needs instead: the log-sum-exp
from float32 tile statistics, the chosen logit in float32, and softmax as float16 e * exp(m - lse),
whose 2^-11 relative rounding is below that of dL/dlogits' own bf16 (2^-9).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tandem.kernels.logprobs import BETA, DELTA, EPSILON, EPSILON_HIGH

BLOCK_V = 2048


@triton.jit
def _lse_pass(zb, V, inv_t, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    """One read of a row of logits: (log-sum-exp, entropy or 0) of logits * inv_t, float32."""
    m = -float("inf")
    s = 0.0
    t = 0.0  # sum exp(z - m) * z, for the entropy
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        ok = offs < V
        z = tl.load(zb + offs, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - m_new)
        e = tl.where(ok, tl.exp(z - m_new), 0.0)
        s = s * scale + tl.sum(e, 0)
        if WITH_ENT:
            t = t * scale + tl.sum(tl.where(e > 0.0, e * tl.where(ok, z, 0.0), 0.0), 0)  # 0 * -inf = NaN
        m = m_new
    lse = m + tl.log(s)
    return lse, lse - t / s


@triton.jit
def _grad_pass(zb, db, coef, lse, tok, V, inv_t, BLOCK: tl.constexpr):
    """dL/dlogits = coef * (onehot - softmax) over a row; coef 0 (masked row): zeros, logits unread.
    db may alias zb (same row start, element size <= z's): each block's stores land at or before the
    bytes this program has already loaded, never on a block still to be read."""
    if coef == 0.0:
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            tl.store(db + offs, tl.zeros([BLOCK], tl.float32).to(db.dtype.element_ty), mask=offs < V)
    else:
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            ok = offs < V
            z = tl.load(zb + offs, mask=ok, other=0.0).to(tl.float32) * inv_t
            d = coef * (tl.where(offs == tok, 1.0, 0.0) - tl.exp(z - lse))
            tl.store(db + offs, d.to(db.dtype.element_ty), mask=ok)


@triton.jit
def _row_stats(z_ptr, z_stride, ids_ptr, logp_ptr, lse_ptr, ent_ptr, V, inv_t,
               WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * z_stride
    lse, ent = _lse_pass(base, V, inv_t, WITH_ENT, BLOCK)
    tok = tl.load(ids_ptr + row)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.load(base + tok).to(tl.float32) * inv_t - lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, ent)


@triton.jit
def _row_grad(z_ptr, z_stride, d_ptr, d_stride, ids_ptr, lse_ptr, g_ptr, V, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    coef = tl.load(g_ptr + row).to(tl.float32) * inv_t
    _grad_pass(z_ptr + row * z_stride, d_ptr + row * d_stride, coef, tl.load(lse_ptr + row), tl.load(ids_ptr + row),
               V, inv_t, BLOCK)


@triton.jit
def _grpo_token(lp, old, adv, tis, ref, lo, hi, delta, beta, HAS_KL: tl.constexpr):
    """GRPO per-token loss and its derivative in the log-prob (docs/grpo.md §4.3-4.7; must equal
    learner/grpo.py's per_token_loss at token level, tests/unit/test_kernels_triton.py):
    -min(min(r, delta) A, clip(r, lo, hi) A) * tis + beta * k3, r = exp(clamp(lp - old, +-20)).
    Gradients follow torch's: clamp passes them on the closed interval, minimum splits ties."""
    lr = lp - old
    r = tl.exp(tl.minimum(tl.maximum(lr, -20.0), 20.0))
    dr = tl.where(tl.abs(lr) <= 20.0, r, 0.0)  # d r / d lp
    u = tl.minimum(r, delta)
    du = tl.where(r <= delta, 1.0, 0.0)
    c = tl.minimum(tl.maximum(r, lo), hi)
    dc = tl.where((r >= lo) & (r <= hi), 1.0, 0.0)
    ua = u * adv
    ca = c * adv
    val = tl.minimum(ua, ca)
    dval = tl.where(ua < ca, du, tl.where(ua > ca, dc, 0.5 * (du + dc))) * adv
    loss = -val * tis
    grad = -dval * tis * dr
    if HAS_KL:
        dk = ref - lp
        dkc = tl.minimum(tl.maximum(dk, -20.0), 20.0)
        ek = tl.exp(dkc)
        loss += beta * (ek - dkc - 1.0)
        grad += beta * tl.where(tl.abs(dk) <= 20.0, 1.0 - ek, 0.0)
    return loss, grad


@triton.jit
def _lse_from_tiles(pm_ptr, ps_ptr, pt_ptr, NP, WITH_ENT: tl.constexpr, PBLOCK: tl.constexpr):
    """A row's (log-sum-exp, entropy or 0) from the logits matmul's per-tile max m_j, sum exp(s - m_j)
    and sum exp(s - m_j) * s (s = logits / T), NP <= PBLOCK tiles: no read of the logits."""
    offs = tl.arange(0, PBLOCK)
    ok = offs < NP
    pm = tl.load(pm_ptr + offs, mask=ok, other=-float("inf"))
    mx = tl.max(pm, 0)
    w = tl.where(ok, tl.exp(pm - mx), 0.0)
    s = tl.sum(w * tl.load(ps_ptr + offs, mask=ok, other=0.0), 0)
    lse = mx + tl.log(s)
    ent = 0.0
    if WITH_ENT:
        ent = lse - tl.sum(w * tl.load(pt_ptr + offs, mask=ok, other=0.0), 0) / s
    return lse, ent


@triton.jit
def _grpo_coef(row, lp, logp_ptr, loss_ptr, old_ptr, adv_ptr, wt_ptr, tis_ptr, ref_ptr, inv_t, lo, hi, delta, beta,
               log_cap, log_min, HAS_KL: tl.constexpr, ON_POLICY: tl.constexpr, TIS_LP: tl.constexpr,
               TIS_MASK: tl.constexpr):
    """A row's log-prob lp stored, its weighted GRPO loss stored, dL/dlp * weight / T returned. TIS_LP: tis_ptr
    holds the sampler's log-prob and the truncated-IS weight is taken from lp (on-policy: old = lp), a constant:
    exp(clamp(lp - sampler, log_min, log_cap)), or with TIS_MASK 0 outside [log_min, log_cap] (token modes of
    learner.grpo.tis_weight)."""
    tl.store(logp_ptr + row, lp)
    if TIS_LP:
        d = lp - tl.load(tis_ptr + row)
        if TIS_MASK:
            tis = tl.where((d > log_cap) | (d < log_min), 0.0, tl.exp(tl.minimum(d, log_cap)))
        else:
            tis = tl.exp(tl.minimum(tl.maximum(d, log_min), log_cap))
    else:
        tis = tl.load(tis_ptr + row)
    wt = tl.load(wt_ptr + row)
    ref = 0.0
    if HAS_KL:
        ref = tl.load(ref_ptr + row)
    if ON_POLICY:  # old = this very log-prob (detached): ratio 1
        old = lp
    else:
        old = tl.load(old_ptr + row)
    loss, g = _grpo_token(lp, old, tl.load(adv_ptr + row), tis, ref, lo, hi, delta, beta, HAS_KL)
    # masked tokens: weight 0, and their inputs may be garbage (inf/NaN): nothing of them passes
    tl.store(loss_ptr + row, tl.where(wt != 0.0, loss * wt, 0.0))
    return tl.where(wt != 0.0, g * wt, 0.0) * inv_t


@triton.jit
def _row_grpo(z_ptr, z_stride, d_ptr, d_stride, ids_ptr, logp_ptr, ent_ptr, loss_ptr,
              old_ptr, adv_ptr, wt_ptr, tis_ptr, ref_ptr, V, inv_t, lo, hi, delta, beta, log_cap, log_min,
              HAS_KL: tl.constexpr, ON_POLICY: tl.constexpr, TIS_LP: tl.constexpr, TIS_MASK: tl.constexpr,
              WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    """One row of float32 logits: log-sum-exp (one pass), the loss, then its gradient written as
    dL/dlogits (in place, a second pass)."""
    row = tl.program_id(0).to(tl.int64)
    zb = z_ptr + row * z_stride
    lse, ent = _lse_pass(zb, V, inv_t, WITH_ENT, BLOCK)
    if WITH_ENT:
        tl.store(ent_ptr + row, ent)
    tok = tl.load(ids_ptr + row)
    lp = tl.load(zb + tok).to(tl.float32) * inv_t - lse
    coef = _grpo_coef(row, lp, logp_ptr, loss_ptr, old_ptr, adv_ptr, wt_ptr, tis_ptr, ref_ptr, inv_t, lo, hi, delta,
                      beta, log_cap, log_min, HAS_KL, ON_POLICY, TIS_LP, TIS_MASK)
    _grad_pass(zb, d_ptr + row * d_stride, coef, lse, tok, V, inv_t, BLOCK)


@triton.jit
def _tiles_grpo(e_ptr, d_ptr, st_ptr, pm_ptr, ps_ptr, pt_ptr, NP, ids_ptr, logp_ptr, ent_ptr, loss_ptr,
                old_ptr, adv_ptr, wt_ptr, tis_ptr, ref_ptr, V, inv_t, lo, hi, delta, beta, log_cap, log_min,
                HAS_KL: tl.constexpr, ON_POLICY: tl.constexpr, TIS_LP: tl.constexpr, TIS_MASK: tl.constexpr,
                WITH_ENT: tl.constexpr, BN: tl.constexpr, TB: tl.constexpr, PBLOCK: tl.constexpr):
    """One row after _logits_tiles: log-sum-exp and entropy from its tile statistics, the log-prob
    from its float32 chosen logit, then dL/dlogits = coef * (onehot - e * exp(m_tile - lse)) from the
    float16 e = exp(s - m_tile), written over e (TB tiles of BN at a time): one read, one write."""
    row = tl.program_id(0).to(tl.int64)
    pm = pm_ptr + row * NP
    lse, ent = _lse_from_tiles(pm, ps_ptr + row * NP, pt_ptr + row * NP, NP, WITH_ENT, PBLOCK)
    if WITH_ENT:
        tl.store(ent_ptr + row, ent)
    coef = _grpo_coef(row, tl.load(st_ptr + row) - lse, logp_ptr, loss_ptr, old_ptr, adv_ptr, wt_ptr, tis_ptr,
                      ref_ptr, inv_t, lo, hi, delta, beta, log_cap, log_min, HAS_KL, ON_POLICY, TIS_LP, TIS_MASK)
    tok = tl.load(ids_ptr + row)
    eb = e_ptr + row * V
    db = d_ptr + row * V
    for t0 in range(0, NP, TB):
        tiles = t0 + tl.arange(0, TB)
        offs = tiles[:, None] * BN + tl.arange(0, BN)[None, :]
        ok = offs < V
        if coef == 0.0:  # masked row: zeros, e unread
            tl.store(db + offs, tl.zeros([TB, BN], tl.float32).to(db.dtype.element_ty), mask=ok)
        else:
            f = tl.exp(tl.load(pm + tiles, mask=tiles < NP, other=-float("inf")) - lse)
            p = tl.load(eb + offs, mask=ok, other=0.0).to(tl.float32) * f[:, None]
            d = coef * (tl.where(offs == tok, 1.0, 0.0) - p)
            tl.store(db + offs, d.to(db.dtype.element_ty), mask=ok)


@triton.jit
def _logits_tiles(h_desc, w_desc, e_desc, ids_ptr, st_ptr, pm_ptr, ps_ptr, pt_ptr, M, N, K, NP, inv_t,
                  NUM_PROGS: tl.constexpr, WITH_ENT: tl.constexpr, UPCAST: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, WS: tl.constexpr):
    """s = h @ w.T / T (float32 accumulation), kept as: per row and BN-wide tile its max m, sum exp(s - m)
    and sum exp(s - m) * s; e = exp(s - m) in float16 (relative error 2^-11, 2 bytes a logit); and
    each row's chosen s in float32 (st, written by the tile holding it).
    Persistent over tiles (consecutive tiles share a w tile; h stays in L2), operands through tensor
    descriptors (TMA on Hopper), e stored whole or (SPLIT) in two halves; WS: Triton's warp
    specialisation. bench/logits_gemm_gpu.py: cuBLAS speed on an H200."""
    num_m = tl.cdiv(M, BM)
    for tile in tl.range(tl.program_id(0), num_m * NP, NUM_PROGS, flatten=True, warp_specialize=WS):
        pid_m = tile % num_m
        pid_n = tile // num_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = h_desc.load([off_m, k])
            b = w_desc.load([off_n, k])
            if UPCAST:  # Triton's interpreter would multiply bf16 bit patterns as integers
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        offs_m = off_m + tl.arange(0, BM)
        ok_m = offs_m < M
        cols = off_n + tl.arange(0, BN)
        ok_n = cols[None, :] < N
        sc = tl.where(ok_n, acc * inv_t, -float("inf"))
        m = tl.max(sc, 1)
        e = tl.exp(sc - m[:, None])
        if SPLIT:
            lo, hi = tl.split(tl.permute(tl.reshape(e.to(tl.float16), (BM, 2, BN // 2)), (0, 2, 1)))
            e_desc.store([off_m, off_n], lo)
            e_desc.store([off_m, off_n + BN // 2], hi)
        else:
            e_desc.store([off_m, off_n], e.to(tl.float16))
        at = offs_m.to(tl.int64) * NP + pid_n
        tl.store(pm_ptr + at, m, mask=ok_m)
        tl.store(ps_ptr + at, tl.sum(e, 1), mask=ok_m)
        if WITH_ENT:
            tl.store(pt_ptr + at, tl.sum(e * tl.where(ok_n, sc, 0.0), 1), mask=ok_m)
        tok = tl.load(ids_ptr + offs_m, mask=ok_m, other=-1)
        st = tl.sum(tl.where(cols[None, :] == tok[:, None], sc, 0.0), 1)
        tl.store(st_ptr + offs_m, st, mask=ok_m & (tok >= off_n) & (tok < off_n + BN))


def _check(name, logits_or_hidden, ids, temperature, chunk=1):
    if chunk is not None and not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"tandem.kernels.{name}: chunk = {chunk!r}; allowed a whole number of rows >= 1")
    if not temperature > 0:
        raise ValueError(f"tandem.kernels.{name}: temperature = {temperature!r}; allowed > 0")
    if ids.shape[0] != logits_or_hidden.shape[0]:
        raise ValueError(f"tandem.kernels.{name}: {ids.shape[0]} token ids for {logits_or_hidden.shape[0]} rows")


def _stats(z, ids, temperature, with_entropy):
    n, V = z.shape
    logp = torch.empty(n, dtype=torch.float32, device=z.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else logp
    if n:
        _row_stats[(n,)](z, z.stride(0), ids, logp, lse, ent, V, 1.0 / temperature,
                         WITH_ENT=with_entropy, BLOCK=BLOCK_V, num_warps=8)
    return logp, lse, (ent if with_entropy else None)


def _grad_into(z, out, ids, lse, g, temperature):
    if z.shape[0]:
        _row_grad[(z.shape[0],)](z, z.stride(0), out, out.stride(0), ids, lse, g, z.shape[1], 1.0 / temperature,
                                 BLOCK=BLOCK_V, num_warps=8)
    return out


def _front_view(z, dtype):
    """A [n, V] `dtype` view over the front of each float32 row of z (row stride kept), so dL/dlogits
    can be written over the logits they come from."""
    if dtype == torch.float32:
        return z
    n, V = z.shape
    per = z.element_size() // torch.empty(0, dtype=dtype).element_size()
    return torch.as_strided(z.view(dtype), (n, V), (V * per, 1))


def _grad_in_place(z, ids, lse, g, temperature, dtype):
    """dL/dlogits of a float32 chunk, written over the chunk itself as `dtype`: a [n, V] view."""
    return _grad_into(z, _front_view(z, dtype), ids, lse, g, temperature)


def _logits_f32(h, w):
    """h [n, H] @ w.T in float32 out, whatever the input dtype (cuBLAS accumulates in float32)."""
    if h.dtype == torch.float32 or not h.is_cuda:
        return h.float() @ w.float().t()
    return torch.mm(h, w.t(), out_dtype=torch.float32)


# BM, BN, BK, warps, stages, SPLIT, WS of _logits_tiles: the fastest in bench/logits_gemm_gpu.py on an H200
TILE = (128, 256, 64, 8, 3, False, False)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _programs(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile_stats_ok(h, w):
    """Whether _logits_tiles serves h @ w.T: bf16/fp16 on a GPU with TMA (compute capability 9+), or
    Triton's interpreter; row strides 16-byte aligned (hidden % 8, vocab % 8). Else cuBLAS + _lse_pass."""
    if h.dtype not in (torch.bfloat16, torch.float16) or w.dtype != h.dtype or h.shape[1] % 8 or w.shape[0] % 8:
        return False
    return _interpreting() or (h.is_cuda and torch.cuda.get_device_capability(h.device)[0] >= 9)


def _logits_with_tiles(h, w, ids, temperature, with_entropy, tile=TILE):
    """_logits_tiles on h [n, H], w [V, H], ids [n] -> e [n, V] float16, st [n] (NaN where an id is
    outside the vocabulary), tile statistics (pm, ps, pt [n, NP], NP)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, warps, stages, split, ws = tile
    (n, H), V = h.shape, w.shape[0]
    NP = triton.cdiv(V, BN)
    e = torch.empty(n, V, dtype=torch.float16, device=h.device)
    st = torch.full((n,), float("nan"), dtype=torch.float32, device=h.device)
    pm = torch.empty(n, NP, dtype=torch.float32, device=h.device)
    ps = torch.empty_like(pm)
    pt = torch.empty_like(pm) if with_entropy else ps
    progs = 4 if _interpreting() else _programs(h.device.index or 0)
    _logits_tiles[(progs,)](TensorDescriptor.from_tensor(h, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]),
                            TensorDescriptor.from_tensor(e, [BM, BN // 2 if split else BN]), ids, st, pm, ps, pt,
                            n, V, H, NP, 1.0 / temperature, NUM_PROGS=progs, WITH_ENT=with_entropy,
                            UPCAST=_interpreting(), BM=BM, BN=BN, BK=BK, SPLIT=split, WS=ws, num_warps=warps,
                            num_stages=stages)
    return e, st, (pm, ps, pt, NP)


def _mm_into(out, d, weight):
    if out.dtype == d.dtype == weight.dtype:
        torch.mm(d, weight, out=out)
    else:
        out.copy_(d.float() @ weight.float())


def _backprop_chunk(d, h, weight, gh, gw, first=False):
    """A chunk's dL/dlogits d [n, V] into grad_hidden rows gh [n, H] and the grad-weight buffer gw
    (either may be None); first: gw is written, not added to (it may be uninitialised)."""
    if gh is not None:
        _mm_into(gh, d, weight)
    if gw is not None:
        _add_grad_weight(gw, d, h, 0.0 if first else 1.0)


def _grad_weight_buffer(weight, need_w, fp32=True, zero=True):
    """zero=False: uninitialised, for a caller whose first chunk writes it whole (no memset pass)."""
    if not need_w:
        return None
    return (torch.zeros if zero else torch.empty)(weight.shape, dtype=torch.float32 if fp32 else weight.dtype,
                                                  device=weight.device)


def _add_grad_weight(acc, d, h, beta=1.0):
    """acc [V, H] = beta * acc + d.T @ h (d, h in the weight dtype; float32 inside the product; acc
    float32 or, by choice, the weight dtype). beta 0: acc is not read (NaN in it does not pass)."""
    if acc.dtype == d.dtype:
        acc.addmm_(d.t(), h, beta=beta)
    elif acc.is_cuda:
        try:
            torch.addmm(acc, d.t(), h, beta=beta, out_dtype=torch.float32, out=acc)
        except (TypeError, RuntimeError):  # torch without mixed-dtype addmm: a float32 temporary
            prod = torch.mm(d.t(), h, out_dtype=torch.float32)
            acc.add_(prod) if beta else acc.copy_(prod)
    else:
        acc.addmm_(d.t().float(), h.float(), beta=beta)


# ---------------------------------------------------------------------------- selective


class _Selective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, with_entropy):
        logp, lse, ent = _stats(logits, ids, temperature, with_entropy)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, _g_ent):
        logits, ids, lse = ctx.saved_tensors
        g = g_logp.float().contiguous() if g_logp is not None else torch.zeros_like(lse)
        return _grad_into(logits, torch.empty_like(logits), ids, lse, g, ctx.temperature), None, None, None


def selective_logprobs_triton(logits, ids, temperature=1.0, with_entropy=False):
    """logits [N, V] (fp32/bf16/fp16) -> (logp [N] float32, entropy [N] float32 or None)."""
    _check("selective_logprobs", logits, ids, temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _Selective.apply(logits, ids.contiguous(), float(temperature), bool(with_entropy))


# ---------------------------------------------------------------------------- linear


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk, with_entropy):
        parts = [_stats(_logits_f32(hidden[s:s + chunk], weight), ids[s:s + chunk], temperature, with_entropy)
                 for s in range(0, hidden.shape[0], chunk)]
        logp = torch.cat([p[0] for p in parts]) if parts else hidden.new_zeros(0, dtype=torch.float32)
        lse = torch.cat([p[1] for p in parts]) if parts else logp
        ent = (torch.cat([p[2] for p in parts]) if parts else logp.clone()) if with_entropy else None
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.args = (temperature, chunk)
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, _g_ent):
        hidden, weight, ids, lse = ctx.saved_tensors
        temperature, chunk = ctx.args
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.empty_like(hidden) if need_h else None
        gw = _grad_weight_buffer(weight, need_w)
        if g_logp is not None and (need_h or need_w):
            g = g_logp.float().contiguous()
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk]
                d = _grad_in_place(_logits_f32(h, weight), ids[s:s + chunk], lse[s:s + chunk], g[s:s + chunk],
                                   temperature, weight.dtype)
                _backprop_chunk(d, h, weight, gh[s:s + chunk] if need_h else None, gw)
                del d  # a view of this chunk's logits: free them before the next chunk's are made
        elif gh is not None:
            gh.zero_()
        return gh, (gw.to(weight.dtype) if gw is not None else None), None, None, None, None


def linear_logprobs_triton(hidden, weight, ids, temperature=1.0, chunk=1024, with_entropy=False):
    """hidden [N, H], lm_head weight [V, H], ids [N] -> (logp [N] float32, entropy [N] or None).
    At most chunk x V float32 logits exist at a time; backward recomputes them a chunk at a time."""
    _check("linear_logprobs", hidden, ids, temperature, chunk)
    return _Linear.apply(hidden.contiguous(), weight.contiguous(), ids.contiguous(), float(temperature),
                         int(chunk), bool(with_entropy))


def _keep_grads(ctx, gh, gw, weight):
    """Hold the gradients formed in forward until backward (the grad-weight buffer in its
    accumulation dtype: backward casts it while scaling)."""
    ctx.grads, ctx.weight_dtype = (gh, gw), weight.dtype


def _scaled_grads(ctx, g_loss):
    """The gradients formed in forward times the upstream scalar, which is never read on the host:
    that would wait for the GPU, which then idles while Python prepares the next step. One Triton
    pass each (_scale_cast, float32 inside: one rounding, not two; torch.mul with a 0-dim factor and
    a dtype change took 3x its memory time on an H200): grad_hidden in place, the grad-weight buffer
    into the weight's dtype."""
    (gh, gw), ctx.grads = ctx.grads, None
    g = g_loss.float()
    if gh is not None:
        _scale_into(gh, g, gh)
    if gw is not None:
        gw = _scale_into(gw, g, gw if gw.dtype == ctx.weight_dtype else
                         torch.empty(gw.shape, dtype=ctx.weight_dtype, device=gw.device))
    return gh, gw


def _scale_into(src, g, dst):
    """dst = src * g (g a float32 0-dim tensor on the device), rounded once to dst's dtype; dst may be src."""
    if src.numel():
        _scale_cast[(triton.cdiv(src.numel(), SCALE_BLOCK),)](src, g, dst, src.numel(), BLOCK=SCALE_BLOCK,
                                                              num_warps=8)
    return dst


SCALE_BLOCK = 8192


@triton.jit
def _scale_cast(src_ptr, g_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = src * g (a 0-dim tensor, read on the device), in dst's dtype (dst may alias src)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(src_ptr + offs, mask=ok) * tl.load(g_ptr).to(tl.float32)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=ok)


def auto_chunk(V, rows, grad_weight_bytes=0, cast_bytes=0, logit_bytes=4):
    """Rows per chunk: logits of `logit_bytes` (float32: 4; _logits_tiles' float16 e: 2) within
    max(0.55 GiB, 1.35 GiB - grad-weight buffer, its cast)
    (the cast of a float32 buffer to the weight dtype is made beside it at the end anyway), so the
    extra memory stays near 1.4 GiB at vocab 152k and hidden 1536, yet chunks stay large enough for
    full-speed matmuls and few read-modify-writes of the buffer; `rows` split evenly (no small tail)."""
    budget = max(0.55 * 2**30, 1.35 * 2**30 - grad_weight_bytes, cast_bytes)
    most = max(128, int(budget // (logit_bytes * V)) // 128 * 128)
    per = -(-rows // max(1, -(-rows // most)))
    return max(128, (per + 127) // 128 * 128)


class _LinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, token_loss, temperature, chunk, with_entropy, need_h, need_w):
        N = hidden.shape[0]
        gh = torch.empty_like(hidden) if need_h else None
        gw = _grad_weight_buffer(weight, need_w)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logps, ents = [], []
        for s in range(0, N, chunk):
            h, t = hidden[s:s + chunk], ids[s:s + chunk]
            z = _logits_f32(h, weight)
            logp, lse, ent = _stats(z, t, temperature, with_entropy)
            with torch.enable_grad():
                lp = logp.detach().requires_grad_()
                part = token_loss(lp, s, s + h.shape[0]).sum()
                (g,) = torch.autograd.grad(part, lp)
            loss += part.detach().float()
            logps.append(logp)
            ents.append(ent)
            if need_h or need_w:
                d = _grad_in_place(z, t, lse, g.float().contiguous(), temperature, weight.dtype)
                _backprop_chunk(d, h, weight, gh[s:s + h.shape[0]] if need_h else None, gw)
                del d  # a view of z: would keep the chunk alive
            del z
        _keep_grads(ctx, gh, gw, weight)
        logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
        ent = (torch.cat(ents) if ents else logp.clone()) if with_entropy else None
        ctx.mark_non_differentiable(logp)
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        return _scaled_grads(ctx, g_loss) + (None,) * 7


def linear_logprobs_loss_triton(hidden, weight, ids, token_loss, temperature=1.0, chunk=1024, with_entropy=False):
    """Fused: loss = sum_t token_loss(logp, start, end)[t] over chunks, its gradients formed in forward.
    token_loss(logp_chunk [n] float32, start, end) -> per-token loss [n]; it must be a sum of per-token
    terms whose other inputs are constants. -> (loss scalar, logp [N] detached, entropy or None)."""
    _check("linear_logprobs_loss", hidden, ids, temperature, chunk)
    loss, logp, ent = _LinearLoss.apply(hidden.contiguous(), weight.contiguous(), ids.contiguous(), token_loss,
                                        float(temperature), int(chunk), bool(with_entropy),
                                        hidden.requires_grad and torch.is_grad_enabled(),
                                        weight.requires_grad and torch.is_grad_enabled())
    return loss, logp.detach(), (ent.detach() if ent is not None else None)


# ---------------------------------------------------------------------------- fused GRPO


def _flat(x, n, name, device):
    if not torch.is_tensor(x):  # a fill, not a host-to-device copy (which would wait for the GPU)
        return torch.full((n,), float(x), dtype=torch.float32, device=device)
    if x.numel() == 1 and n != 1:
        x = x.reshape(()).expand(n)
    if x.shape != (n,):
        raise ValueError(f"tandem.kernels.linear_grpo_loss: {name} has shape {tuple(x.shape)}; needs ({n},)")
    return x.float().contiguous()


class _LinearGRPO(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, tok, params, chunk, with_entropy, need_h, need_w, gw_fp32, tiles):
        N, V = hidden.shape[0], weight.shape[0]
        temperature, lo, hi, delta, beta, log_cap, log_min, tis_lp, tis_mask = params
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(logp) if with_entropy else logp
        loss_tok = torch.empty_like(logp)
        gh = torch.empty_like(hidden) if need_h else None
        gw = _grad_weight_buffer(weight, need_w, gw_fp32, zero=N == 0)
        old, adv, wt, tis, ref = tok
        on_policy = old is None
        old = logp if on_policy else old  # a pointer the kernel never reads
        scalars = (V, 1.0 / temperature, lo, hi, delta, beta, log_cap, log_min)
        flags = dict(HAS_KL=beta > 0, ON_POLICY=on_policy, TIS_LP=tis_lp, TIS_MASK=tis_mask, WITH_ENT=with_entropy,
                     num_warps=8)
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            h = hidden[s:e]
            rows = (ids[s:], logp[s:], ent[s:], loss_tok[s:], old[s:], adv[s:], wt[s:], tis[s:], ref[s:])
            if tiles:
                ex, st, (pm, ps, pt, NP) = _logits_with_tiles(h, weight, ids[s:e], temperature, with_entropy)
                d = ex.view(weight.dtype)  # written over ex, element by element
                _tiles_grpo[(e - s,)](ex, d, st, pm, ps, pt, NP, *rows, *scalars, BN=TILE[1], TB=BLOCK_V // TILE[1],
                                      PBLOCK=triton.next_power_of_2(NP), **flags)
                del ex, st, pm, ps, pt
            else:
                z = _logits_f32(h, weight)
                d = _front_view(z, weight.dtype)
                _row_grpo[(e - s,)](z, z.stride(0), d, d.stride(0), *rows, *scalars, BLOCK=BLOCK_V, **flags)
                del z
            _backprop_chunk(d, h, weight, gh[s:e] if need_h else None, gw, first=s == 0)
            del d  # a view of this chunk's logits: free them before the next chunk's are made
        _keep_grads(ctx, gh, gw, weight)
        del gw
        return loss_tok.sum(), logp, (ent if with_entropy else None)

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        return _scaled_grads(ctx, g_loss) + (None,) * 9


def linear_grpo_loss_triton(hidden, weight, ids, old_logp, advantages, token_weight, *, temperature=1.0,
                            epsilon=EPSILON, epsilon_high=EPSILON_HIGH, delta=DELTA, beta=BETA,
                            ref_logp=None, tis=None, tis_from=None,
                            chunk=None, with_entropy=False, grad_weight_fp32=True, lse_epilogue=True):
    """The GRPO loss straight from hidden states, its gradients formed in forward, logits computed once.

    Flat per-token inputs [N] (scalars broadcast): old_logp (None: on-policy, old = logp detached,
    ratio 1), advantages, token_weight (the loss type's normalisation, 0 on masked tokens: see
    learner.grpo.token_weights), tis (truncated IS weight, 1 if off), ref_logp (needed when beta > 0).
    tis_from (on-policy only, instead of tis): kernels.logprobs.TisFromLogp, the weight taken in the kernel from
    each token's own log-prob and the sampler's, so no separate lm_head pass computes the log-probs first.
    Token-level importance ratios only. chunk None: auto_chunk.
    grad_weight_fp32=False accumulates a trainable lm_head's gradient in its own dtype across chunks
    (as Liger-Kernel does): no float32 [V, H] buffer, half the read-modify-write per chunk.
    lse_epilogue (where tile_stats_ok; else, or False: cuBLAS float32 logits read twice) computes the
    logits with _logits_tiles, whose epilogue keeps per-tile log-sum-exp statistics, the chosen logit
    and float16 exp(s - tile max): 2 bytes a logit, read once by the row kernel (_tiles_grpo).
    -> (loss = sum_t weight_t * loss_t, logp [N] detached, entropy [N] or None)."""
    _check("linear_grpo_loss", hidden, ids, temperature, chunk)
    if beta > 0 and ref_logp is None:
        raise ValueError("tandem.kernels.linear_grpo_loss: beta > 0 needs ref_logp")
    if tis_from is not None and (old_logp is not None or tis is not None):
        raise ValueError("tandem.kernels.linear_grpo_loss: tis_from is the on-policy weight (old_logp None, no tis)")
    N, dev = hidden.shape[0], hidden.device
    tis_in = tis_from.sampler_logp if tis_from is not None else (1.0 if tis is None else tis)
    tok = (None if old_logp is None else _flat(old_logp, N, "old_logp", dev),) + tuple(
        _flat(x, N, name, dev) for x, name in [
            (advantages, "advantages"), (token_weight, "token_weight"), (tis_in, "tis"),
            (0.0 if ref_logp is None else ref_logp, "ref_logp")])
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    log_cap, log_min = tis_from.log_bounds() if tis_from is not None else (0.0, 0.0)
    params = (float(temperature), 1.0 - epsilon, 1.0 + eps_hi, float("inf") if delta is None else float(delta),
              float(beta), log_cap, log_min, tis_from is not None, tis_from is not None and tis_from.masks)
    gw_fp32 = bool(grad_weight_fp32) or weight.dtype == torch.float32
    trains = weight.requires_grad and torch.is_grad_enabled()
    gw_bytes = weight.numel() * (4 if gw_fp32 else weight.element_size()) if trains else 0
    cast_bytes = weight.numel() * weight.element_size() if trains and weight.dtype != torch.float32 and gw_fp32 else 0
    tiles = bool(lse_epilogue) and tile_stats_ok(hidden, weight)
    chunk = auto_chunk(weight.shape[0], N, gw_bytes, cast_bytes, 2 if tiles else 4) if chunk is None else int(chunk)
    loss, logp, ent = _LinearGRPO.apply(hidden.contiguous(), weight.contiguous(), ids.contiguous(), tok, params,
                                        chunk, bool(with_entropy), hidden.requires_grad and torch.is_grad_enabled(),
                                        trains, gw_fp32, tiles)
    return loss, logp.detach(), (ent.detach() if ent is not None else None)
