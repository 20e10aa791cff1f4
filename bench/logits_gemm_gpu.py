"""Can a Triton GEMM with the log-sum-exp in its epilogue beat cuBLAS + the two-read row kernel?

One 2048-row chunk of the 1.5B lm_head (2048 x 1536 x 151936, bf16): the shipped path (cuBLAS logits
in float32, then `_row_grpo` reading them twice) against a Triton matmul that also writes each row's
per-tile max and sum of exp, so the row kernel needs one read. The idea that would take the frozen
lm_head below 1.25x the matmul floor, if the Triton matmul ran at cuBLAS speed.
Run on the GPU machine: python3 bench/logits_gemm_gpu.py  (on CPU, TRITON_INTERPRET=1: a tiny shape,
correctness only)
"""
import os

import torch
import triton
import triton.language as tl
from tandem.kernels.triton_logprobs import _front_view, _grad_pass, _grpo_token, _row_grpo

TEMP = 0.7


@triton.jit
def _logits_stats(h_ptr, w_ptr, z_ptr, pm_ptr, ps_ptr, M, N, K, z_stride, NP, inv_t,
                  STATS: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m  # consecutive programs share a W tile (h is small and stays in L2)
    pid_n = pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] + k < K), other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 bit patterns as integers
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    ok_m = offs_m < M
    tl.store(z_ptr + offs_m[:, None].to(tl.int64) * z_stride + offs_n[None, :], acc,
             mask=ok_m[:, None] & (offs_n[None, :] < N))
    if STATS:
        s = tl.where(offs_n[None, :] < N, acc * inv_t, -float("inf"))
        m = tl.max(s, 1)
        se = tl.sum(tl.exp(s - m[:, None]), 1)
        tl.store(pm_ptr + offs_m.to(tl.int64) * NP + pid_n, m, mask=ok_m)
        tl.store(ps_ptr + offs_m.to(tl.int64) * NP + pid_n, se, mask=ok_m)


@triton.jit
def _logits_stats_tma(a_desc, b_desc, z_desc, pm_ptr, ps_ptr, M, N, K, NP, inv_t, NUM_PROGS: tl.constexpr,
                      STATS: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The same with tensor descriptors (TMA on Hopper), persistent over tiles, the float32 tile stored
    in two halves (a whole 128 x 256 float32 tile would not fit shared memory beside the pipeline)."""
    num_m = tl.cdiv(M, BM)
    num_tiles = num_m * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
        pid_m = tile % num_m
        pid_n = tile // num_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([off_m, k])
            b = b_desc.load([off_n, k])
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        acc2 = tl.reshape(acc, (BM, 2, BN // 2))
        acc2 = tl.permute(acc2, (0, 2, 1))
        lo, hi = tl.split(acc2)
        z_desc.store([off_m, off_n], lo)
        z_desc.store([off_m, off_n + BN // 2], hi)
        if STATS:
            offs_m = off_m + tl.arange(0, BM)
            offs_n = off_n + tl.arange(0, BN)
            s = tl.where(offs_n[None, :] < N, acc * inv_t, -float("inf"))
            m = tl.max(s, 1)
            se = tl.sum(tl.exp(s - m[:, None]), 1)
            tl.store(pm_ptr + offs_m.to(tl.int64) * NP + pid_n, m, mask=offs_m < M)
            tl.store(ps_ptr + offs_m.to(tl.int64) * NP + pid_n, se, mask=offs_m < M)


@triton.jit
def _row_grpo_1p(z_ptr, z_stride, d_ptr, d_stride, pm_ptr, ps_ptr, NP, ids_ptr, logp_ptr, loss_ptr,
                 old_ptr, adv_ptr, wt_ptr, tis_ptr, V, inv_t, lo, hi, delta,
                 BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zb = z_ptr + row * z_stride
    m = -float("inf")
    s = 0.0
    for p0 in range(0, NP, PBLOCK):
        offs = p0 + tl.arange(0, PBLOCK)
        ok = offs < NP
        pm = tl.load(pm_ptr + row * NP + offs, mask=ok, other=-float("inf"))
        ps = tl.load(ps_ptr + row * NP + offs, mask=ok, other=0.0)
        mn = tl.maximum(m, tl.max(pm, 0))
        s = s * tl.exp(m - mn) + tl.sum(tl.where(ok, ps * tl.exp(pm - mn), 0.0), 0)
        m = mn
    lse = m + tl.log(s)
    tok = tl.load(ids_ptr + row)
    lp = tl.load(zb + tok) * inv_t - lse
    tl.store(logp_ptr + row, lp)
    wt = tl.load(wt_ptr + row)
    loss, g = _grpo_token(lp, tl.load(old_ptr + row), tl.load(adv_ptr + row), tl.load(tis_ptr + row), 0.0,
                          lo, hi, delta, 0.0, False)
    tl.store(loss_ptr + row, tl.where(wt != 0.0, loss * wt, 0.0))
    coef = tl.where(wt != 0.0, g * wt, 0.0) * inv_t
    _grad_pass(zb, d_ptr + row * d_stride, coef, lse, tok, V, inv_t, BLOCK)


def gemm(h, w, z, cfg, stats=True):
    """z = h @ w.T (float32) and, per row and BN-wide tile, max and sum exp of z / T."""
    BM, BN, BK, nw, ns = cfg
    M, K = h.shape
    N = w.shape[0]
    NP = triton.cdiv(N, BN)
    pm = torch.empty(M, NP, device=h.device)
    ps = torch.empty_like(pm)
    _logits_stats[(triton.cdiv(M, BM) * NP,)](h, w, z, pm, ps, M, N, K, z.stride(0), NP, 1 / TEMP, STATS=stats,
                                               UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
                                               BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns)
    return pm, ps


def gemm_tma(h, w, z, cfg, stats=True):
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, nw, ns = cfg
    M, K = h.shape
    N = w.shape[0]
    NP = triton.cdiv(N, BN)
    pm = torch.empty(M, NP, device=h.device)
    ps = torch.empty_like(pm)
    progs = torch.cuda.get_device_properties(0).multi_processor_count if h.is_cuda else 4
    a_desc = TensorDescriptor.from_tensor(h, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    z_desc = TensorDescriptor.from_tensor(z, [BM, BN // 2])
    _logits_stats_tma[(min(progs, triton.cdiv(M, BM) * NP),)](
        a_desc, b_desc, z_desc, pm, ps, M, N, K, NP, 1 / TEMP, NUM_PROGS=min(progs, triton.cdiv(M, BM) * NP),
        STATS=stats, UPCAST=os.environ.get("TRITON_INTERPRET") == "1", BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns)
    return pm, ps


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    M, K, N = (2048, 1536, 151936) if dev == "cuda" else (37, 48, 300)
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(M, K, device=dev, generator=g).bfloat16()
    w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
    ids = torch.randint(0, N, (M,), device=dev, generator=g)
    ones = lambda: torch.ones(M, device=dev)
    logp, ent, loss, adv, wt, tis, ref = [ones() for _ in range(7)]
    old = ones() - 12
    z64 = h.double() @ w.double().t() / TEMP
    lse64 = torch.logsumexp(z64, -1)
    lp64 = z64.gather(-1, ids[:, None]).squeeze(-1) - lse64
    cuda = dev == "cuda"
    bench = (lambda fn: triton.testing.do_bench(fn, return_mode="median")) if cuda else (lambda fn: (fn(), 1.0)[1])
    logits = (lambda: torch.mm(h, w.t(), out_dtype=torch.float32)) if cuda else (lambda: h.float() @ w.float().t())
    z0 = logits()
    z = z0.clone()
    t_copy = bench(lambda: z.copy_(z0))
    t_cub = bench(logits)

    def two_reads():  # the shipped path's row kernel, on a fresh copy of the logits (it writes over them)
        z.copy_(z0)
        d = _front_view(z, torch.bfloat16)
        _row_grpo[(M,)](z, N, d, d.stride(0), ids, logp, ent, loss, old, adv, wt, tis, ref, N, 1 / TEMP, 0.8, 1.2,
                        float("inf"), 0.0, HAS_KL=False, ON_POLICY=False, WITH_ENT=False, BLOCK=2048, num_warps=8)
    two_reads()
    err_two = (logp.double() - lp64).abs().max().item()
    t_two = bench(two_reads) - t_copy
    cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)] if cuda else [(16, 64, 16, 4, 1)]
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, triton {triton.__version__}: chunk {M} x {K} x {N}")
    print("| logits + log-sum-exp | matmul µs | row kernel µs | total µs | × shipped | max abs lse / logp err |")
    print("|---|---|---|---|---|---|")
    shipped = t_cub + t_two
    print(f"| cuBLAS float32 out + two-read row kernel (shipped) | {t_cub * 1e3:.0f} | {t_two * 1e3:.0f} | "
          f"{shipped * 1e3:.0f} | 1.00 | logp {err_two:.1e} |")
    lp1 = torch.empty_like(logp)
    tma_cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 2), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3)] if cuda \
        else [(16, 64, 16, 4, 1)]
    runs = [(c, "pointers", gemm) for c in cfgs] + [(c, "TMA, persistent", gemm_tma)
                                                     for c in tma_cfgs]
    for cfg, kind, fn in runs:
        try:
            pm, ps = fn(h, w, z, cfg)
            z1 = z.clone()
            NP = pm.shape[1]
            err_l = (torch.logsumexp(pm.double() + ps.double().log(), -1) - lse64).abs().max().item()

            def one_read(z1=z1, pm=pm, ps=ps, NP=NP):
                z.copy_(z1)
                d = _front_view(z, torch.bfloat16)
                _row_grpo_1p[(M,)](z, N, d, d.stride(0), pm, ps, NP, ids, lp1, loss, old, adv, wt, tis, N, 1 / TEMP,
                                   0.8, 1.2, float("inf"), BLOCK=2048, PBLOCK=1024, num_warps=8)
            one_read()
            err_p = (lp1.double() - lp64).abs().max().item()
            t_plain = bench(lambda cfg=cfg, fn=fn: fn(h, w, z, cfg, stats=False))
            t_gemm = bench(lambda cfg=cfg, fn=fn: fn(h, w, z, cfg))
            t_one = bench(one_read) - t_copy
            tot = t_gemm + t_one
            print(f"| Triton {kind} {cfg} (BM, BN, BK, warps, stages), log-sum-exp in the epilogue (plain: "
                  f"{t_plain * 1e3:.0f}) + one-read row kernel | {t_gemm * 1e3:.0f} | {t_one * 1e3:.0f} | "
                  f"{tot * 1e3:.0f} | {tot / shipped:.2f} | lse {err_l:.1e}, logp {err_p:.1e} |", flush=True)
        except Exception as e:
            print(f"| Triton {kind} {cfg} | {type(e).__name__}: {str(e)[:120]} |", flush=True)


if __name__ == "__main__":
    main()
