"""Hidden states -> chosen-token log-probs -> GRPO loss, forward + backward, on one GPU.

Candidates, side by side in one process (bf16, temperature 0.7, dapo loss, epsilon 0.2):
  naive     full bf16 logits, float32 log_softmax, gather
  trl       TRL's selective_log_softmax for bf16: full bf16 logits, log_softmax row by row
  chunked   chunks of 1024 rows, float32 log-softmax, recomputed in backward (Unsloth's approach)
  compiled  torch.compile of the chunk function of `chunked`
  liger     Liger-Kernel's LigerFusedLinearGRPOLoss
  ours      tandem.kernels linear_logprobs (Triton) + the loss through autograd (4 matmuls)
  fused     tandem.kernels linear_logprobs_loss: gradients formed in forward (3 matmuls), any per-token
            loss given as a PyTorch function (autograd per chunk)
  linear_grpo_loss      tandem.kernels linear_grpo_loss: the same with the GRPO derivative inside the row kernel,
            the logits matmul keeping log-sum-exp statistics and float16 exp(logit - tile max)
            (_logits_tiles, 2 bytes a logit, read once), chunk sized by memory;
            linear_grpo_loss_bf16acc: the same, a trainable lm_head's gradient accumulated in bf16 (as Liger does);
            grpo_cublas(_bf16acc): float32 logits from cuBLAS, read twice (lse_epilogue=False)
and the floor: cuBLAS bf16 time of the matmuls the computation needs (logits, grad_hidden, and
grad_weight when the lm_head trains), measured before and after the candidates (the H200's clock
falls under sustained load) and averaged. Time: median (triton do_bench); memory: peak allocated
over what inputs hold, gradients included. err: max |logp - float64| over the first 1024 rows.

Run on the GPU machine: python3 bench/logprobs_gpu.py [--tokens 4096,16384,32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
from torch.utils.checkpoint import checkpoint

from tandem.kernels.logprobs import selective_logprobs_reference
from tandem.kernels.triton_logprobs import linear_grpo_loss_triton, linear_logprobs_loss_triton, linear_logprobs_triton
from tandem.learner.grpo import aggregate_loss, grpo_token_terms, per_token_loss, token_weights

TEMP, T, EPS = 0.7, 1024, 0.2
SHAPES = {"1.5B": (1536, 151936), "7B": (3584, 152064)}


def loss_of(logp, old, adv, mask):
    return aggregate_loss(per_token_loss(logp.view_as(old), old, adv, mask, epsilon=EPS), mask, "dapo")


def naive(h, w, ids, old, adv, mask):
    logits = (h @ w.t()).float() / TEMP
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    return loss_of(logp, old, adv, mask), logp


def trl(h, w, ids, old, adv, mask):
    logits = (h @ w.t()).view(old.shape[0], T, -1) / TEMP  # bf16, as TRL's model output
    rows = [torch.log_softmax(r, -1).gather(-1, i[:, None]).squeeze(-1) for r, i in zip(logits, ids.view(-1, T))]
    logp = torch.stack(rows).float()
    return loss_of(logp, old, adv, mask), logp


def _chunk(h, w, ids):
    z = (h @ w.t()).float() / TEMP
    return z.gather(-1, ids[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


_compiled_chunk = torch.compile(_chunk, dynamic=False)


def _chunked_with(fn):
    def run(h, w, ids, old, adv, mask, chunk=1024):
        logp = torch.cat([checkpoint(fn, h[s:s + chunk], w, ids[s:s + chunk], use_reentrant=False)
                          for s in range(0, h.shape[0], chunk)])
        return loss_of(logp, old, adv, mask), logp
    return run


def ours(h, w, ids, old, adv, mask):
    logp, _ = linear_logprobs_triton(h, w, ids, TEMP, 1024)
    return loss_of(logp, old, adv, mask), logp


def fused(h, w, ids, old, adv, mask, chunk=1024):
    tl = grpo_token_terms(old.reshape(-1), adv.repeat_interleave(T), token_weights(mask, "dapo").reshape(-1),
                         epsilon=EPS)
    loss, logp, _ = linear_logprobs_loss_triton(h, w, ids, tl, TEMP, chunk)
    return loss, logp


def linear_grpo_loss_candidate(h, w, ids, old, adv, mask, gw_fp32=True, chunk=None, epilogue=True):
    wt = token_weights(mask, "dapo").reshape(-1)
    loss, logp, _ = linear_grpo_loss_triton(h, w, ids, old.reshape(-1), adv.repeat_interleave(T), wt,
                                            temperature=TEMP, epsilon=EPS, grad_weight_fp32=gw_fp32, chunk=chunk,
                                            lse_epilogue=epilogue)
    return loss, logp


def liger_candidate():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as e:
        print("liger: not importable:", e)
        return None
    mods = [LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", temperature=TEMP,
                                     epsilon_low=EPS, epsilon_high=EPS, compiled=c) for c in (True, False)]

    def run(h, w, ids, old, adv, mask):
        while True:
            try:
                out = mods[0](h.view(old.shape[0], T, -1), w, ids.view(old.shape), mask.long(), adv,
                              old_per_token_logps=old)
                return (out[0] if isinstance(out, tuple) else out), None
            except Exception as e:  # torch.compile of Liger's chunk fails on some shapes: run it eager
                if len(mods) == 1:
                    raise
                print(f"liger: compiled=True failed ({type(e).__name__}); compiled=False from here", flush=True)
                mods.pop(0)
    return run


def float64_logp(h, w, ids, rows=1024):
    return selective_logprobs_reference(h[:rows].double() @ w.double().t(), ids[:rows], TEMP)[0]


def measure(fn, h, w, inputs, ref_lp, ref_loss):
    torch.cuda.synchronize()
    h.grad = w.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, logp = fn(h, w, *inputs)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    err = (logp.reshape(-1)[:ref_lp.numel()].double() - ref_lp).abs().max().item() if logp is not None else float("nan")
    loss_err = abs(loss.item() - ref_loss)
    gh = h.grad.clone()
    gw = w.grad.clone() if w.grad is not None else None

    def step():
        loss, _ = fn(h, w, *inputs)
        loss.backward()
    ms = triton.testing.do_bench(step, warmup=50, rep=300, grad_to_none=[h, w], return_mode="median")
    h.grad = w.grad = None
    return ms, peak / 2**30, err, loss_err, gh, gw


def floor(N, H, V, trainable):
    a = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b.t(), return_mode="median")
    t += triton.testing.do_bench(lambda: d @ b, return_mode="median")
    if trainable:
        t += triton.testing.do_bench(lambda: d.t() @ a, return_mode="median")
    return t, (3 if trainable else 2) * 2 * N * H * V / t / 1e9  # tensors freed on return


def profile(N=16384, model="1.5B", trainable=False):
    """Where the linear_grpo_loss path's time goes: the top CUDA kernels of a few steps."""
    H, V = SHAPES[model]
    h = torch.randn(N, H, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16().requires_grad_(trainable)
    ids = torch.randint(0, V, (N,), device="cuda")
    old = torch.randn(N // T, T, device="cuda") - 12
    adv, mask = torch.randn(N // T, device="cuda"), torch.ones(N // T, T, device="cuda", dtype=torch.bool)
    for _ in range(2):
        linear_grpo_loss_candidate(h, w, ids, old, adv, mask)[0].backward()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            linear_grpo_loss_candidate(h, w, ids, old, adv, mask)[0].backward()
        torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(3):
        linear_grpo_loss_candidate(h, w, ids, old, adv, mask)[0].backward()
    t1.record()
    torch.cuda.synchronize()
    print(f"3 iterations unprofiled: wall {t0.elapsed_time(t1):.1f} ms")
    print(f"profile linear_grpo_loss N={N} {model} trainable={trainable}: peak extra "
          f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GB")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    # cuBLAS efficiency of each of the three products by rows per chunk (TFLOP/s)
    for rows in (1024, 1920, 2048, 4096, N):
        print(f"rows {rows}: TFLOP/s " + ", ".join(f"{k} {v:.0f}" for k, v in product_rates(rows, H, w.detach()).items()))


def product_rates(rows, H, w):
    V = w.shape[0]
    a = torch.randn(rows, H, device="cuda").bfloat16()
    d = torch.randn(rows, V, device="cuda").bfloat16()
    fl = 2 * rows * H * V / 1e9
    return {name: fl / triton.testing.do_bench(f, return_mode="median") for name, f in [
        ("logits f32 out", lambda: torch.mm(a, w.t(), out_dtype=torch.float32)), ("grad_hidden", lambda: d @ w),
        ("grad_weight f32 out", lambda: torch.mm(d.t(), a, out_dtype=torch.float32))]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384,32768")
    ap.add_argument("--models", default="1.5B,7B")
    ap.add_argument("--candidates",
                    default="naive,trl,chunked,compiled,liger,ours,fused,linear_grpo_loss_cublas,linear_grpo_loss_cublas_bf16acc,linear_grpo_loss,linear_grpo_loss_bf16acc")
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.profile:
        profile(trainable=False)
        profile(trainable=True)
        return
    torch._dynamo.config.cache_size_limit = 64
    cands = {"naive": naive, "trl": trl, "chunked": _chunked_with(_chunk), "compiled": _chunked_with(_compiled_chunk),
             "liger": liger_candidate(), "ours": ours, "fused": fused, "linear_grpo_loss": linear_grpo_loss_candidate,
             "linear_grpo_loss_bf16acc": lambda *x: linear_grpo_loss_candidate(*x, gw_fp32=False), "linear_grpo_loss_cublas": lambda *x: linear_grpo_loss_candidate(*x, epilogue=False),
             "linear_grpo_loss_cublas_bf16acc": lambda *x: linear_grpo_loss_candidate(*x, gw_fp32=False, epilogue=False)}
    for c in a.candidates.split(","):  # linear_grpo_loss@2048: linear_grpo_loss with a fixed chunk of rows
        base, _, rows_ = c.partition("@")
        if rows_ and base in ("linear_grpo_loss", "linear_grpo_loss_bf16acc"):
            cands[c] = lambda *x, r=int(rows_), fp32=base == "linear_grpo_loss": linear_grpo_loss_candidate(*x, gw_fp32=fp32, chunk=r)
    names = [c for c in a.candidates.split(",") if cands.get(c) is not None]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    rows = []
    for model in a.models.split(","):
        H, V = SHAPES[model]
        for N in map(int, a.tokens.split(",")):
            B = N // T
            g = torch.Generator(device="cuda").manual_seed(N + H)
            w0 = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
            h0 = torch.randn(N, H, device="cuda", generator=g).bfloat16()
            ids = torch.randint(0, V, (N,), device="cuda", generator=g)
            mask = torch.ones(B, T, device="cuda", dtype=torch.bool)
            adv = torch.randn(B, device="cuda", generator=g)
            ref_lp = float64_logp(h0, w0, ids)
            with torch.no_grad():
                lp_all, _ = linear_logprobs_triton(h0, w0, ids, TEMP, 1024)
            old = (lp_all + 0.05 * torch.randn(N, device="cuda", generator=g)).view(B, T)
            ref_loss = loss_of(lp_all.double(), old.double(), adv.double(), mask).item()
            for trainable in (True, False):
                t_floor, tflops = floor(N, H, V, trainable)
                torch.cuda.empty_cache()
                row = {"model": model, "tokens": N, "lm_head": "trainable" if trainable else "frozen",
                       "floor_ms": t_floor, "floor_tflops": tflops}
                h = h0.clone().requires_grad_()
                w = w0.clone().requires_grad_(trainable)
                grads = {}
                for name in names:
                    try:
                        ms, gb, err, lerr, gh, gw = measure(cands[name], h, w, (ids, old, adv, mask), ref_lp, ref_loss)
                    except Exception as e:
                        print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        ms = gb = err = lerr = float("nan")
                        gh = gw = None
                        torch.cuda.empty_cache()
                    grads[name] = (gh, gw)
                    row[name] = {"ms": ms, "gb": gb, "err": err, "loss_err": lerr}
                    print(f"{model} N={N} {row['lm_head']:9s} {name:9s} {ms:8.2f} ms {gb:7.2f} GB "
                          f"err {err:.1e} loss_err {lerr:.1e}", flush=True)
                # every candidate's gradients against naive's (float32 softmax of bf16 logits), or else
                # against grpo_cublas's (float32 logits)
                base = grads.get("naive") or grads.get("linear_grpo_loss_cublas")
                if base and base[0] is not None:
                    for name, (gh, gw) in grads.items():
                        if gh is None:
                            continue
                        rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()
                        row[name]["grad_h_rel"] = rel(gh, base[0])
                        row[name]["grad_w_rel"] = rel(gw, base[1]) if gw is not None and base[1] is not None else None
                del grads
                # the clock drifts with power and heat: the floor is measured before and after the candidates
                t_after, _ = floor(N, H, V, trainable)
                row.update(floor_before_ms=t_floor, floor_after_ms=t_after, floor_ms=(t_floor + t_after) / 2)
                rows.append(row)
                with open(os.path.join(a.out, "logprobs_gpu.json"), "w") as f:  # kept if the run is cut short
                    json.dump(rows, f, indent=1)
                del h, w
                torch.cuda.empty_cache()
            del w0, h0
            torch.cuda.empty_cache()
    print(table(rows, names))


def table(rows, names):
    head = "| model | tokens | lm_head | floor ms (before/after) | " + " | ".join(names) + " |"
    out = [f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}: median ms (× floor) / peak extra GB",
           "", head, "|" + "---|" * (4 + len(names))]
    for r in rows:
        cells = []
        for n in names:
            c = r[n]
            cells.append(f"{c['ms']:.1f} ({c['ms'] / r['floor_ms']:.2f}×) / {c['gb']:.2f}")
        fl = f"{r['floor_ms']:.1f}" + (f" ({r['floor_before_ms']:.1f}/{r['floor_after_ms']:.1f})" if "floor_after_ms" in r else "")
        out.append(f"| {r['model']} | {r['tokens']} | {r['lm_head']} | {fl} | " + " | ".join(cells) + " |")
    ref = "naive" if "naive" in names else "linear_grpo_loss_cublas"
    out += ["", f"max |logp - float64| (first 1024 rows) and gradient (gh: grad_hidden) rel. to {ref}:", ""]
    for r in rows:
        out.append(f"{r['model']} {r['tokens']} {r['lm_head']}: " + ", ".join(
            f"{n} {r[n]['err']:.1e}" + (f" gh {r[n]['grad_h_rel']:.1e}" if r[n].get('grad_h_rel') is not None else "")
            for n in names))
    return "\n".join(out)


if __name__ == "__main__":
    main()
