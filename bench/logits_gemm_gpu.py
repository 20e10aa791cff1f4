"""Can a Triton matmul with the log-sum-exp in its epilogue beat cuBLAS + the two-read row kernel?

One 2048-row chunk of the 1.5B lm_head (2048 x 1536 x 151936, bf16): the cuBLAS path (logits in
float32, then `_row_grpo` reading them twice) against matmuls that also keep each row's per-tile max
and sum of exp, so `_row_grpo` (FROM_TILES) reads them once: a plain pointer-load Triton matmul (the
prototype below) and the shipped persistent TMA one (`_logits_tiles`, `lse_epilogue=True`), in
several tile shapes. Run on the GPU machine: python3 bench/logits_gemm_gpu.py  (on CPU with
TRITON_INTERPRET=1: a tiny shape, correctness only)
"""
import os

import torch
import triton
import triton.language as tl
from tandem.kernels.triton_logprobs import _front_view, _logits_with_tiles, _row_grpo

TEMP = 0.7


@triton.jit
def _logits_stats(h_ptr, w_ptr, z_ptr, pm_ptr, ps_ptr, M, N, K, z_stride, NP, inv_t,
                  UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Prototype: z = h @ w.T with pointer loads (no TMA, not persistent), per-tile max and sum exp."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m  # consecutive programs share a w tile (h is small and stays in L2)
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
        if UPCAST:  # Triton's interpreter would multiply bf16 bit patterns as integers
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    ok_m = offs_m < M
    tl.store(z_ptr + offs_m[:, None].to(tl.int64) * z_stride + offs_n[None, :], acc,
             mask=ok_m[:, None] & (offs_n[None, :] < N))
    s = tl.where(offs_n[None, :] < N, acc * inv_t, -float("inf"))
    m = tl.max(s, 1)
    tl.store(pm_ptr + offs_m.to(tl.int64) * NP + pid_n, m, mask=ok_m)
    tl.store(ps_ptr + offs_m.to(tl.int64) * NP + pid_n, tl.sum(tl.exp(s - m[:, None]), 1), mask=ok_m)


def pointers(h, w, cfg):
    BM, BN, BK, warps, stages = cfg
    (M, K), N = h.shape, w.shape[0]
    NP = triton.cdiv(N, BN)
    z = torch.empty(M, N, device=h.device)
    pm = torch.empty(M, NP, device=h.device)
    ps = torch.empty_like(pm)
    _logits_stats[(triton.cdiv(M, BM) * NP,)](h, w, z, pm, ps, M, N, K, z.stride(0), NP, 1 / TEMP,
                                               UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
                                               BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)
    return z, (pm, ps, ps, NP)


def tma(h, w, cfg):
    return _logits_with_tiles(h, w, TEMP, False, tile=cfg)


def main():
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    M, K, N = (2048, 1536, 151936) if cuda else (37, 48, 300)
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
    bench = (lambda fn: triton.testing.do_bench(fn, return_mode="median")) if cuda else (lambda fn: (fn(), 1.0)[1])
    cublas = (lambda: torch.mm(h, w.t(), out_dtype=torch.float32)) if cuda else (lambda: h.float() @ w.float().t())

    def row(z0, tiles):
        """_row_grpo on a fresh copy of z0 (it writes over the logits); tiles: one read, else two."""
        z = z0.clone()
        pm, ps, pt, NP = tiles or (z, z, z, 0)
        d = _front_view(z, torch.bfloat16)

        def run():
            z.copy_(z0)
            _row_grpo[(M,)](z, N, d, d.stride(0), ids, logp, ent, loss, old, adv, wt, tis, ref, N, 1 / TEMP, 0.8, 1.2,
                            float("inf"), 0.0, pm, ps, pt, NP, HAS_KL=False, ON_POLICY=False, WITH_ENT=False,
                            BLOCK=2048, FROM_TILES=tiles is not None,
                            PBLOCK=triton.next_power_of_2(NP) if tiles else 1, num_warps=8)
        run()
        err = (logp.double() - lp64).abs().max().item()
        return bench(run) - bench(lambda: z.copy_(z0)), err

    t_cub = bench(cublas)
    t_row, err = row(cublas(), None)
    shipped = t_cub + t_row
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, triton {triton.__version__}: chunk {M} x {K} x {N}")
    print("| logits + log-sum-exp | matmul µs | row kernel µs | total µs | × cuBLAS path | max abs lse / logp err |")
    print("|---|---|---|---|---|---|")
    print(f"| cuBLAS float32 out + two-read row kernel | {t_cub * 1e3:.0f} | {t_row * 1e3:.0f} | {shipped * 1e3:.0f} "
          f"| 1.00 | logp {err:.1e} |")
    cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)] if cuda else [(16, 64, 16, 4, 1)]
    tma_cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 2), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3)] if cuda \
        else [(16, 64, 16, 4, 1)]
    for kind, fn, cs in (("pointers", pointers, cfgs), ("TMA, persistent (shipped kernel)", tma, tma_cfgs)):
        for cfg in cs:
            try:
                z, tiles = fn(h, w, cfg)
                pm, ps, _, NP = tiles
                err_l = (torch.logsumexp(pm.double() + ps.double().log(), -1) - lse64).abs().max().item()
                t_mm = bench(lambda fn=fn, cfg=cfg: fn(h, w, cfg))
                t_one, err_p = row(z, tiles)
                tot = t_mm + t_one
                print(f"| Triton {kind} {cfg} (BM, BN, BK, warps, stages) + one-read row kernel | {t_mm * 1e3:.0f} | "
                      f"{t_one * 1e3:.0f} | {tot * 1e3:.0f} | {tot / shipped:.2f} | lse {err_l:.1e}, logp {err_p:.1e} |",
                      flush=True)
            except Exception as e:  # a tile shape that does not fit the chip
                print(f"| Triton {kind} {cfg} | {type(e).__name__}: {str(e)[:120]} |", flush=True)


if __name__ == "__main__":
    main()
