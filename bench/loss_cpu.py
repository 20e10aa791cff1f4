"""GRPO loss on CPU: time per call (forward + backward), B=64, T=1024, float32.

    .venv/bin/python bench/loss_cpu.py
"""

import platform
import statistics
import time

import torch

from tandem.learner.grpo import aggregate_loss, loss_metrics, per_token_loss

B, T = 64, 1024
VARIANTS = {
    "token, dapo": dict(),
    "sequence (GSPO), dapo": dict(importance_sampling_level="sequence"),
    "token + delta + TIS": dict(delta=1.5, tis=True),
    "token + TIS + KL (beta 0.04)": dict(tis=True, beta=0.04),
}


def main():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.1 * torch.randn(B, T, generator=g)
    samp = old + 0.1 * torch.randn(B, T, generator=g)
    ref = logp + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    rows = []
    for name, v in VARIANTS.items():
        kw = dict(delta=v.get("delta"), importance_sampling_level=v.get("importance_sampling_level", "token"),
                  beta=v.get("beta", 0.0), ref_logp=ref if v.get("beta") else None,
                  sampler_logp=samp if v.get("tis") else None, tis_cap=2.0 if v.get("tis") else None)
        times = []
        for i in range(25):
            x = logp.clone().requires_grad_(True)
            t0 = time.perf_counter()
            loss = aggregate_loss(per_token_loss(x, old, adv, mask, **kw), mask, "dapo")
            loss.backward()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loss_metrics(logp, old, adv, mask, sampler_logp=kw["sampler_logp"], tis_cap=kw["tis_cap"], ref_logp=kw["ref_logp"])
        tm = time.perf_counter() - t0
        rows.append((name, statistics.median(times[5:]) * 1e3, tm * 1e3))
    base = rows[0][1]
    print(f"GRPO loss, B={B} T={T} float32, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("| variant | fwd+bwd ms | ratio | metrics ms |")
    print("| --- | --: | --: | --: |")
    for name, ms, mm in rows:
        print(f"| {name} | {ms:.2f} | {ms / base:.2f} | {mm:.2f} |")


if __name__ == "__main__":
    main()
