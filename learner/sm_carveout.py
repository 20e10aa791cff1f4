"""`cluster.learner_sm_carveout`: the learner's matmuls leave some of the GPU's SMs to a rollout engine running its
kernels at the same time (one process, `vllm_mode: colocate`). What `auto` chooses is pure arithmetic; applying it
is one process-wide torch setting."""

from __future__ import annotations

import torch

# auto's share of the SMs: 24 of an H100's or H200's 132. At 7B on one H200 the colocated engine ran at 0.52 of its
# speed alone beside the learner with 24 SMs left to it against 0.49 with none, at no cost to the learner's step
# (17.0 against 17.4 s a step over a period: bench/results/e2e_gpu_scale.md, the 2026-12-03 run (ea098c1)); every
# colocated run since used 24.
AUTO_SHARE = 24 / 132


def carveout_sms(setting: int | str | None, vllm_mode: str, sms: int, torch_has_it: bool) -> int | None:
    """SMs the learner leaves free: `setting` where it is a number; for `auto` AUTO_SHARE of the GPU's `sms` in the
    colocated mode where torch has the carveout, else none (two processes only take turns on a GPU, so SMs left
    free by one are not the other's)."""
    if setting != "auto":
        return setting
    return max(1, round(sms * AUTO_SHARE)) if vllm_mode == "colocate" and torch_has_it and sms > 1 else None


def apply_carveout(cluster, device) -> int | None:
    """The learner's `cluster.learner_sm_carveout` on its CUDA `device`; the SMs it left free, or None."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = carveout_sms(cluster.learner_sm_carveout, cluster.vllm_mode, sms, supported())
    if n:
        leave_sms_free(n, device)
        print(f"learner: its matmuls leave {n} of {sms} SMs to the engine (cluster.learner_sm_carveout "
              f"{cluster.learner_sm_carveout})", flush=True)
    return n


def supported() -> bool:
    """Whether this torch has the SM carveout (an experimental API: `torch._C`)."""
    return hasattr(torch._C, "_set_sm_carveout_experimental")


def leave_sms_free(n: int, device) -> None:
    """This process's matmuls on all but `n` of the GPU's SMs: torch's SM carveout, which only cuBLASLt honours
    (aten/src/ATen/cuda/CUDABlas.cpp), so cuBLASLt becomes the preferred BLAS. Process-wide: in the colocated mode
    the engine's matmuls too, except those in the CUDA graphs it captured before (its decode)."""
    if not supported():
        raise RuntimeError(f"cluster.learner_sm_carveout = {n}: torch {torch.__version__} has no SM carveout; "
                           "allowed: null or auto with this torch")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < n < sms:
        raise ValueError(f"cluster.learner_sm_carveout = {n}: {torch.cuda.get_device_name(device)} has {sms} SMs; "
                         f"allowed: 1 to {sms - 1}, auto, or null")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(n)
