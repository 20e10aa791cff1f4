"""The learner's metrics: each loss metric's reduction over micro-steps and ranks, by an explicit table (a
renamed metric must be listed again: its spelling decides nothing), and the generation batch's statistics."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from tandem.learner.batch import Samples
from tandem.learner.grpo import total_rewards

# how a loss metric (learner.grpo.loss_metrics) becomes one number per optimizer step: "mean" is weighted by the
# tokens of each micro-step (every rank's), "min"/"max" over them; "sum" adds
REDUCTIONS = {
    "clip_ratio/low_mean": "mean", "clip_ratio/high_mean": "mean", "clip_ratio/region_mean": "mean",
    "kl": "mean", "entropy": "mean",
    "tis/weight_mean": "mean", "tis/weight_min": "min", "tis/weight_max": "max", "tis/capped_frac": "mean",
    "tis/sampler_abs_diff_mean": "mean",
    "tokens": "sum",
}


def accumulate(acc: dict, m: dict) -> None:
    """One micro-step's metrics into the step's accumulator: token-weighted sums, running min and max."""
    n = m["tokens"]
    for k, v in m.items():
        how = REDUCTIONS.get(k)
        if how is None:
            raise KeyError(f"learner metric {k!r} has no reduction in tandem.learner.metrics.REDUCTIONS; allowed: "
                           f"add it there as mean, min, max or sum")
        if how == "sum":
            acc[k] = acc.get(k, 0.0) + v
        elif how == "mean":
            acc[k] = acc.get(k, 0.0) + v * n
        elif how == "min":
            acc[k] = min(acc.get(k, math.inf), v if n else math.inf)
        else:
            acc[k] = max(acc.get(k, -math.inf), v if n else -math.inf)


def reduce_metrics(acc: dict, loss_sum: float, world: int = 1, device="cpu") -> dict:
    """The step's metrics over every rank: token-weighted means, min, max and sums, the summed loss."""
    by = {how: sorted(k for k in acc if REDUCTIONS[k] == how) for how in ("mean", "min", "max", "sum")}
    summed = by["mean"] + by["sum"]
    vec = torch.tensor([acc[k] for k in summed] + [loss_sum], dtype=torch.float64, device=device)  # NCCL: GPU tensors
    extremes = {how: {k: acc[k] for k in by[how]} for how in ("min", "max")}
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(vec)
        for how, op in (("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
            d = extremes[how]
            if d:
                t = torch.tensor(list(d.values()), dtype=torch.float64, device=device)
                dist.all_reduce(t, op=op)
                d.update(zip(d, t.tolist()))
    vals = dict(zip(summed, vec.tolist()))
    tokens = max(vals.get("tokens", 0.0), 1.0)
    out = {k: vals[k] / tokens for k in by["mean"]} | {k: vals[k] for k in by["sum"] if k != "tokens"}
    # an all-masked step has no min/max: report 0 rather than inf
    out.update({k: (v if math.isfinite(v) else 0.0) for k, v in (extremes["min"] | extremes["max"]).items()})
    out["loss"] = vec[-1].item()
    out["tokens"] = tokens
    return out


def rollout_stats(s: Samples, G: int, weights, version: int, rewards: np.ndarray | None = None) -> dict:
    """Reward and completion statistics of the generation batch (docs/grpo.md §5). `rewards`: the columns trained
    on (the functions', plus the overlong penalty when on); default the functions'."""
    rewards = s.rewards if rewards is None else rewards
    r, valid = total_rewards(torch.from_numpy(rewards), weights)
    r = r[valid]
    lengths = np.array([len(c) for c in s.completions])
    grp = torch.from_numpy(rewards).nan_to_num(0.0).sum(1).view(-1, G)
    out = {
        "reward": float(r.mean()) if len(r) else 0.0,
        "reward_std": float(r.std()) if len(r) > 1 else 0.0,
        "frac_reward_zero_std": float((grp.max(1).values == grp.min(1).values).float().mean()),
        "completion_length": float(lengths.mean()),
        "completion_length_min": float(lengths.min()),
        "completion_length_max": float(lengths.max()),
        "completion_length_p50": float(np.percentile(lengths, 50)),
        "completion_length_p95": float(np.percentile(lengths, 95)),
        "frac_truncated": float(1 - s.eos.mean()),
        # TRL's completions/*_terminated_length: the completions that ended by EOS (0 where none did)
        "completion_length_terminated": float(lengths[s.eos].mean()) if s.eos.any() else 0.0,
        "completion_length_terminated_min": float(lengths[s.eos].min()) if s.eos.any() else 0.0,
        "completion_length_terminated_max": float(lengths[s.eos].max()) if s.eos.any() else 0.0,
        "version_lag": float(np.mean(version - s.versions)),
        "version_lag_max": float(np.max(version - s.versions)),
        **token_accounting(s, version),
    }
    for f in range(rewards.shape[1]):
        col = rewards[:, f]
        col = col[~np.isnan(col)]
        out[f"rewards/{f}/mean"] = float(col.mean()) if len(col) else 0.0
        out[f"rewards/{f}/std"] = float(col.std(ddof=1)) if len(col) > 1 else 0.0
    return out


def token_accounting(s: Samples, version: int) -> dict:
    """What the batch trains, by token: rollout/version_lag (mean and max over the tokens the loss sees, each token's
    own version against the weights `version` that train on it), rollout/inflight_updated (sequences sampled under
    more than one version), rollout/stale_masked_tokens (the model's tokens too old for the bound), and
    rollout/trained_tokens (the tokens the loss sees; a truncated completion masked by mask_truncated_completions
    counts here too)."""
    lags = [version - v[m] for v, m in zip(s.token_versions, s.loss_masks) if m.any()]
    lag = np.concatenate(lags) if lags else np.zeros(0)
    return {"rollout/version_lag": float(lag.mean()) if len(lag) else 0.0,
            "rollout/version_lag_max": float(lag.max()) if len(lag) else 0.0,
            "rollout/inflight_updated": float(sum(len(np.unique(v)) > 1 for v in s.token_versions)),
            "rollout/stale_masked_tokens": float(s.stale_tokens),
            "rollout/trained_tokens": float(sum(int(m.sum()) for m in s.loss_masks))}


def memory_peaks(device) -> dict:
    """learner/peak_allocated_gib and learner/peak_reserved_gib: the most this process's tensors held on its GPU, and
    the most its caching allocator held for them (what nvidia-smi sees of it), since the process started; colocated,
    the engine's tensors are in it too (verl logs the same pair, perf/max_memory_allocated_gb and _reserved_gb).
    The difference is the allocator's slack. Nothing off a GPU."""
    if torch.device(device).type != "cuda":
        return {}
    gib = float(1 << 30)
    out = {"learner/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
           "learner/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib}
    outside = outside_allocator_gib(device)
    if outside is not None:
        out["learner/outside_allocator_gib"] = outside
    return out


def outside_allocator_gib(device) -> float | None:
    """What the driver counts for this process beyond what torch's allocator holds now: the CUDA context, NCCL's
    buffers, library workspaces, which no tensor of torch's accounts for. None off a GPU or where NVML cannot say."""
    held = process_gpu_bytes() if torch.device(device).type == "cuda" else None
    return None if held is None else (held - torch.cuda.memory_reserved(device)) / float(1 << 30)


def process_gpu_bytes(pid: int | None = None) -> int | None:
    """What the driver counts for process `pid` (this one by default) on every GPU it sees, as nvidia-smi lists it
    (NVML); None where NVML is missing or does not list the process (a PID namespace it cannot see into)."""
    try:
        import pynvml
    except ImportError:
        try:
            from vllm.third_party import pynvml  # vLLM carries its own copy; a GPU learner has vLLM installed
        except ImportError:
            return None
    pid = os.getpid() if pid is None else pid
    try:
        pynvml.nvmlInit()
        used = [p.usedGpuMemory for i in range(pynvml.nvmlDeviceGetCount())
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                if p.pid == pid and p.usedGpuMemory is not None]
    except pynvml.NVMLError:
        return None
    return sum(used) if used else None


def train_phases(start: float, prepared: float, trained: float, end: float) -> dict:
    """Where a `train` call's time went (verl's timing_s/* in spirit): learner/time/prepare_s, the host's work before
    the first forward (the groups fetched, advantages, the forwards packed and moved to the device);
    forwards_s, every forward, backward and optimizer step (old and reference log-probs included; each forward ends
    in a host sync on its loss, so this is the device's time too); finish_s, the batch's statistics after. They add
    up to train_s."""
    return {"learner/time/prepare_s": prepared - start, "learner/time/forwards_s": trained - prepared,
            "learner/time/finish_s": end - trained}
