"""One chunk of the GRPO head: cuBLAS float32 logits + the two-read row kernel, against the shipped
_logits_tiles (log-sum-exp statistics, the chosen logit and float16 exp(logit - tile max) kept by the
matmul's epilogue) + the one-read row kernel _tiles_grpo, in several tile shapes.

One 2048-row chunk of the 1.5B lm_head (2048 x 1536 x 151936, bf16). Row-kernel times are measured
on a fresh copy of the matmul's output each run (the kernels write over it) minus the copy.
Run on the GPU machine: python3 bench/logits_gemm_gpu.py  (on CPU with TRITON_INTERPRET=1: a tiny
shape, correctness only)
"""
import torch
import triton

from tandem.kernels.triton_logprobs import BLOCK_V, _front_view, _logits_with_tiles, _row_grpo, _tiles_grpo

TEMP = 0.7


def main():
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    M, K, N = (2048, 1536, 151936) if cuda else (37, 48, 296)
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(M, K, device=dev, generator=g).bfloat16()
    w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
    ids = torch.randint(0, N, (M,), device=dev, generator=g)
    ones = lambda: torch.ones(M, device=dev)
    logp, ent, loss, adv, wt, tis, ref = [ones() for _ in range(7)]
    old = ones() - 12
    rows = (ids, logp, ent, loss, old, adv, wt, tis, ref, N, 1 / TEMP, 0.8, 1.2, float("inf"), 0.0)
    flags = dict(HAS_KL=False, ON_POLICY=False, WITH_ENT=False, num_warps=8)
    z64 = h.double() @ w.double().t() / TEMP
    lse64 = torch.logsumexp(z64, -1)
    lp64 = z64.gather(-1, ids[:, None]).squeeze(-1) - lse64
    bench = (lambda fn: triton.testing.do_bench(fn, return_mode="median")) if cuda else (lambda fn: (fn(), 1.0)[1])
    cublas = (lambda: torch.mm(h, w.t(), out_dtype=torch.float32)) if cuda else (lambda: h.float() @ w.float().t())

    def timed_row(x0, launch):
        """A row kernel on a fresh copy of x0 each run (it writes over it), minus the copy."""
        x = x0.clone()
        logp.fill_(float("nan"))

        def run():
            x.copy_(x0)
            launch(x)
        run()
        err = (logp.double() - lp64).abs().max().item()
        return bench(run) - bench(lambda: x.copy_(x0)), err

    def two_reads(z):
        d = _front_view(z, torch.bfloat16)
        _row_grpo[(M,)](z, N, d, d.stride(0), *rows, BLOCK=BLOCK_V, **flags)

    t_cub = bench(cublas)
    t_row, err = timed_row(cublas(), two_reads)
    base = t_cub + t_row
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, triton {triton.__version__}: chunk {M} x {K} x {N}")
    print("| logits + log-sum-exp | matmul µs | row kernel µs | total µs | × cuBLAS path | max abs lse / logp err |")
    print("|---|---|---|---|---|---|")
    print(f"| cuBLAS float32 out + two-read row kernel | {t_cub * 1e3:.0f} | {t_row * 1e3:.0f} | {base * 1e3:.0f} "
          f"| 1.00 | logp {err:.1e} |")
    cfgs = [(128, 256, 64, 8, 3, True, False), (128, 256, 64, 8, 3, False, False), (128, 256, 64, 8, 4, False, False),
            (128, 256, 64, 8, 3, True, True), (128, 256, 64, 8, 3, False, True), (128, 256, 64, 4, 3, False, True),
            (128, 128, 64, 4, 4, False, True), (128, 256, 128, 8, 2, False, False)] if cuda \
        else [(16, 64, 16, 4, 1, True, False), (16, 64, 16, 4, 1, False, False)]
    for cfg in cfgs:
        try:
            e, st, (pm, ps, pt, NP) = _logits_with_tiles(h, w, ids, TEMP, False, tile=cfg)
            err_l = (torch.logsumexp(pm.double() + ps.double().log(), -1) - lse64).abs().max().item()
            t_mm = bench(lambda cfg=cfg: _logits_with_tiles(h, w, ids, TEMP, False, tile=cfg))

            def one_read(x, st=st, pm=pm, ps=ps, pt=pt, NP=NP, BN=cfg[1]):
                _tiles_grpo[(M,)](x, x.view(torch.bfloat16), st, pm, ps, pt, NP, *rows, BN=BN, TB=BLOCK_V // BN,
                                  PBLOCK=triton.next_power_of_2(NP), **flags)
            t_one, err_p = timed_row(e, one_read)
            tot = t_mm + t_one
            print(f"| _logits_tiles {cfg} (BM, BN, BK, warps, stages, split, warp-specialised), float16 e + one-read row kernel | "
                  f"{t_mm * 1e3:.0f} | {t_one * 1e3:.0f} | {tot * 1e3:.0f} | {tot / base:.2f} | "
                  f"lse {err_l:.1e}, logp {err_p:.1e} |", flush=True)
        except Exception as ex:  # a tile shape that does not fit the chip
            print(f"| _logits_tiles {cfg} | {type(ex).__name__}: {str(ex)[:120]} |", flush=True)


if __name__ == "__main__":
    main()
