"""The learner's `train` call on the end-to-end workload's generation batch (32 prompts x 8 completions
x 256 tokens on GPU), in this process (no Ray), three ways side by side:

- old_forward+peft: a no-grad forward of the whole model for the old log-probs, then the training passes,
  peft's LoRA forward (the learner of session 8; TRL does the same whenever TIS is on);
- from_training_pass+peft: one optimizer step per cycle, so the training pass's own log-probs are the old
  ones and TIS takes its weight from them (session 9);
- from_training_pass+fused: the same with every LoRA layer through `kernels.lora_linear` (the default now).

Then a torch.profiler trace of one `train` call: where the learner's GPU time goes.

  python3 bench/learner.py --workload gpu|cpu [--reps 4] [--dir WORK] [--no-profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import e2e  # noqa: E402 - the workload (model, job) of the end-to-end benchmark


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpu", choices=list(e2e.WORKLOADS))
    ap.add_argument("--dir", default="/tmp/tandem-e2e")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    import torch

    from tandem.learner.actor import Learner

    wl = e2e.WORKLOADS[a.workload]
    paths = e2e.prepare(Path(a.dir), wl)
    args = argparse.Namespace(workload=a.workload, rollout_gpus=0.0, learner_gpus=1.0, vllm_memory=0.3, dir=a.dir)
    cfg = e2e.tandem_config(paths, wl, 0, args)
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
    if a.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        lr.train(groups)
        sync()
        wall = time.perf_counter() - t
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    ev = prof.key_averages()
    if torch.cuda.is_available():
        from torch.autograd import DeviceType

        busy = sum(e.self_device_time_total for e in ev if e.device_type == DeviceType.CUDA) / 1e6  # kernels only
        print(f"\nprofiled train: wall {wall:.3f} s, kernels {busy:.3f} s ({busy / wall:.0%} of the wall time)")
    print(ev.table(sort_by=key, row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
