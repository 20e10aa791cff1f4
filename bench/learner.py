"""The learner's `train` call on the end-to-end workload's generation batch (32 prompts x 8 completions
x 256 tokens on GPU), in this process (no Ray), three ways side by side:

- old_forward+peft: a no-grad forward of the whole model for the old log-probs, then the training passes,
  peft's LoRA forward (the first learner's layout; TRL does the same whenever TIS is on);
- from_training_pass+peft: one optimizer step per cycle, so the training pass's own log-probs are the old
  ones and TIS takes its weight from them;
- from_training_pass+fused: the same with every LoRA layer through `kernels.lora_linear` (the default now).

Then a torch.profiler trace of one `train` call: where the learner's GPU time goes.

  python3 bench/learner.py --workload gpu|cpu [--reps 4] [--dir WORK] [--no-profile]

The scale workloads (`--workload 1.5b_longtail|7b|cpu_longtail`) compare learner layouts instead: each
`--layouts` entry PER_DEVICE:GA:CHECKPOINTING[:TOKENS[:LIGER[:READBACKS]]] (checkpointing and liger on|off|auto;
tokens: plan = one forward per micro-batch, auto, or model.max_tokens_per_forward's number; readbacks one|per-tensor,
`readbacks` below) is a learner of its own on the same generation batch, whose
completion lengths are long-tailed as the workload's warm-up teaches (geometric with median cap / median_div, every
long_every-th group and a long_frac share at the cap; no warm-up needed here), the profile taken on the last layout.

  python3 bench/learner.py --workload 1.5b_longtail --layouts 8:16:on,8:16:off,8:16:auto:auto:auto [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import tandem_candidates  # noqa: E402
import workloads  # noqa: E402


def generation_batch(n: int, wl, vocab: int, seed: int = 0):
    """Groups shaped like the workload's: every completion at full length (a random model rarely stops),
    sampler log-probs near a uniform policy's."""
    import numpy as np

    from tandem.core.protocol import RolloutGroup, pack_completions

    rng = np.random.default_rng(seed)
    G, T = wl["num_generations"], wl["max_tokens"]
    out = []
    for i in range(n):
        t, off = pack_completions([rng.integers(3, vocab, size=T).astype(np.int32) for _ in range(G)])
        out.append(RolloutGroup(
            group_id=i, index=i, prompt_ids=rng.integers(3, vocab, size=24).astype(np.int32), tokens=t, offsets=off,
            sampler_logprobs=(np.log(1 / vocab) + 0.3 * rng.standard_normal(len(t))).astype(np.float32),
            eos=np.zeros(G, bool), rewards=rng.random((G, 1)).astype(np.float32), version=0))
    return out


def long_tail_batch(n: int, wl, vocab: int, seed: int = 0):
    """Groups whose completion lengths follow the workload's long tail: the warm-up's distribution; of a
    workload without one (7b), every completion at the cap, as its untaught model samples them."""
    import numpy as np

    from tandem.core.protocol import RolloutGroup, pack_completions

    rng = np.random.default_rng(seed)
    G, cap, lt = wl["num_generations"], wl["max_tokens"], wl.get("longtail") or {"long_frac": 1.0}
    p = 1 - 0.5 ** (1 / max(cap / lt.get("median_div", 7), 1))
    out = []
    for i in range(n):
        long = workloads.long_prompt(i, wl)  # a long prompt's group runs to the cap
        lens = [cap if long or rng.random() < lt["long_frac"] else min(int(rng.geometric(p)), cap) for _ in range(G)]
        t, off = pack_completions([rng.integers(3, vocab, size=n_).astype(np.int32) for n_ in lens])
        out.append(RolloutGroup(
            group_id=i, index=i, prompt_ids=rng.integers(3, vocab, size=40).astype(np.int32), tokens=t, offsets=off,
            sampler_logprobs=(np.log(1 / vocab) + 0.3 * rng.standard_normal(len(t))).astype(np.float32),
            eos=np.asarray([n_ < cap for n_ in lens]), rewards=rng.random((G, 1)).astype(np.float32), version=0))
    return out


def layouts(a, wl):
    """The learner's layouts side by side on one long-tailed generation batch."""
    import gc

    import torch

    from tandem.learner.actor import Learner

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    paths = workloads.prepare(Path(a.dir), {k: v for k, v in wl.items() if k != "longtail"})  # lengths made here
    rows, lr = [], None
    for spec in a.layouts.split(","):
        parts = spec.split(":")
        pd, ga, ck, tokens, liger, reads = parts + ["", "", "", "plan", "off", "one"][len(parts):]
        w = {**wl, "per_device": int(pd), "ga": int(ga),
             "tandem_checkpointing": {"on": True, "off": False, "auto": "auto"}[ck],
             "max_tokens_per_forward": {"plan": None, "auto": "auto"}[tokens] if tokens in ("plan", "auto")
             else int(tokens),
             "use_liger_kernel": {"on": True, "off": False, "auto": "auto"}[liger]}
        args = argparse.Namespace(workload=a.workload, rollout_gpus=0.0, learner_gpus=1.0, vllm_memory=0.3,
                                  dir=a.dir)
        lr = Learner(tandem_candidates.tandem_config(paths, w, 0, args), total_steps=1000)
        lr.setup()
        readbacks(lr, reads)
        groups = long_tail_batch(lr.plan.unique_prompts, wl, wl["model"]["vocab"])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for rep in range(a.reps + 1):  # the first warms up
            sync()
            t = time.perf_counter()
            out = lr.train(groups)
            sync()
            if rep:
                times.append(time.perf_counter() - t)
        st = out["steps"][0]
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        rows.append((spec, statistics.median(times), st["learner/tokens_per_s"], st.get("learner/mfu"),
                     st["learner/padding_frac"], peak, st["learner/forwards_per_step"], lr.token_budget,
                     st["learner/gradient_checkpointing"]))
        print(f"{spec}: {rows[-1]}", flush=True)
        if spec != a.layouts.split(",")[-1]:
            del lr, out
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    lens = [len(g.completion(k)) for g in groups for k in range(g.num_generations)]
    import numpy as np

    print(f"\nlearner.train on {len(groups)} groups x {wl['num_generations']} completions, lengths p50 "
          f"{np.percentile(lens, 50):.0f} p95 {np.percentile(lens, 95):.0f} max {max(lens)} of {wl['max_tokens']} "
          f"({sum(x == wl['max_tokens'] for x in lens)} at the cap), {sum(lens)} completion tokens, "
          f"{wl['model']['dtype']}, {a.reps} reps, median s:")
    print("| per_device:GA:checkpointing:tokens:liger | tokens per forward | forwards | checkpointing | s per train | "
          "× first | learner tokens/s | learner/mfu | padding | peak GiB |\n"
          "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for spec, t, tps, mfu, pad, peak, fw, budget, ck in rows:
        print(f"| {spec} | {budget or 'plan'} | {fw:g} | {'on' if ck else 'off'} | {t:.3f} | {rows[0][1] / t:.2f} | "
              f"{tps:,.0f} | {'-' if mfu is None else f'{mfu:.3f}'} | {pad:.2f} | {peak:.1f} |")
    return lr, groups


# Kernel names by what they do (cuBLAS/CUTLASS matmuls, FlashAttention, Liger's norms and SwiGLU, the lm_head's
# log-prob kernels of kernels/triton_logprobs.py, torch's elementwise and reduction kernels, copies); first match wins.
KERNEL_KINDS = (("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "splitk")),
                ("attention", ("flash", "fmha", "attn")),
                ("norm+swiglu", ("rms_norm", "swiglu")),
                ("logprobs", ("_logits_tiles", "_tiles_grpo", "_row_", "_lse_", "_grad_pass", "_scale_cast")),
                ("elementwise", ("elementwise", "vectorized", "unrolled")),
                ("reduce", ("reduce",)),
                ("copy", ("memcpy", "memset", "copy", "cat")))


def kernel_kinds(kernels: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds of kernel time by KERNEL_KINDS (and "other"), largest first."""
    out: dict[str, float] = {}
    for name, t in kernels:
        low = name.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p in low for p in pats)), "other")
        out[kind] = out.get(kind, 0.0) + t
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def readbacks(lr, how: str) -> None:
    """A layout's GPU readbacks: "one" (today's: DeepSpeed's inf/NaN check in one readback, learner/overflow.py; the
    masked tokens' positions found on the host by learner/batch.py's to_device) or "per-tensor" (before commit b4d5fbf:
    DeepSpeed's own check, a readback per gradient; the positions found on the GPU, a readback per forward)."""
    import tandem.learner.logprobs as logprobs
    from tandem.learner.batch import mask_positions

    own = getattr(logprobs, "_own_masked_positions", logprobs.masked_positions)  # this process's first patch kept
    logprobs._own_masked_positions = own
    if how == "one":
        logprobs.masked_positions = own
        return
    if how != "per-tensor":
        raise SystemExit(f"--layouts: readbacks {how!r}; allowed: one, per-tensor")
    checker = getattr(lr.engine.optimizer, "overflow_checker", None)
    if checker is not None and "has_overflow" in vars(checker):
        del checker.has_overflow  # the class's own method again
    logprobs.masked_positions = lambda batch: mask_positions(batch["mask"])


def profiled(lr, groups, sync):
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        lr.train(groups)
        sync()
        wall = time.perf_counter() - t
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    ev = prof.key_averages()
    out = os.environ.get("OUT")
    if out:  # the whole trace, for the GPU's idle gaps between kernels (bench/trace_gaps.py reads it)
        trace = str(Path(out) / "learner_trace.json.gz")
        prof.export_chrome_trace(trace)  # gzipped by its suffix
        import trace_gaps

        print(trace_gaps.gaps(trace_gaps.load(trace)), flush=True)
    if torch.cuda.is_available():
        from torch.autograd import DeviceType

        kernels = [(e.key, e.self_device_time_total / 1e6) for e in ev if e.device_type == DeviceType.CUDA]
        busy = sum(t for _, t in kernels)
        print(f"\nprofiled train: wall {wall:.3f} s, kernels {busy:.3f} s ({busy / wall:.0%} of the wall time)")
        print("kernel time by kind: " + ", ".join(f"{k} {t:.3f} s ({t / max(busy, 1e-9):.0%})"
                                                    for k, t in kernel_kinds(kernels).items()))
    print(ev.table(sort_by=key, row_limit=25, max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpu", choices=list(workloads.WORKLOADS))
    ap.add_argument("--dir", default="/tmp/tandem-e2e")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--layouts", default="8:16:on,8:16:off,8:16:auto:auto:off,8:16:auto:auto:auto")
    a = ap.parse_args()
    import torch

    wl = workloads.WORKLOADS[a.workload]
    if wl.get("longtail") or a.workload == "7b":
        lr, groups = layouts(a, wl)
        if not a.no_profile:
            profiled(lr, groups, torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
        return

    from tandem.learner.actor import Learner

    paths = workloads.prepare(Path(a.dir), wl)
    args = argparse.Namespace(workload=a.workload, rollout_gpus=0.0, learner_gpus=1.0, vllm_memory=0.3, dir=a.dir)
    cfg = tandem_candidates.tandem_config(paths, wl, 0, args)
    lr = Learner(cfg, total_steps=1000)
    t0 = time.time()
    lr.setup()
    print(f"setup {time.time() - t0:.1f} s on {lr.device}", flush=True)
    groups = generation_batch(lr.plan.unique_prompts, wl, wl["model"]["vocab"])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    default = lr.needs_old
    lora = [m for m in lr.model.modules() if hasattr(m, "_peft_forward")]
    fused = {id(m): m.forward for m in lora}

    def use_fused(on: bool):
        for m in lora:
            m.forward = fused[id(m)] if on else m._peft_forward

    ways = {"old_forward+peft": (lambda: True, False), "from_training_pass+peft": (default, False),
            "from_training_pass+fused": (default, True)}
    first = next(iter(ways))
    print(f"{len(lora)} LoRA layers fused", flush=True)
    times = {k: [] for k in ways}
    for rep in range(a.reps + 1):  # the first round warms up
        for name, (needs, on) in ways.items():
            lr.needs_old = needs
            use_fused(on)
            sync()
            t = time.perf_counter()
            out = lr.train(groups)
            sync()
            if rep:
                times[name].append(time.perf_counter() - t)
    lr.needs_old = default
    use_fused(True)
    tokens = out["steps"][0]["learner/tokens_per_s"] * out["steps"][0]["train_s"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nlearner.train on {len(groups)} groups x {wl['num_generations']} completions x {wl['max_tokens']} "
          f"tokens ({tokens:.0f} tokens), {wl['model']['dtype']}, {a.reps} reps, median s:")
    print(f"| path | s per train | × {first} | tokens/s |\n| --- | --- | --- | --- |")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {v / med[first]:.2f} | {tokens / v:.0f} |")
    if not a.no_profile:
        profiled(lr, groups, sync)


if __name__ == "__main__":
    main()
