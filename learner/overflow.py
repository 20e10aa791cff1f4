"""DeepSpeed's inf/NaN check of an optimizer step's gradients, in one readback instead of one per tensor.

In bf16 at ZeRO-0, DeepSpeed steps through its FP16_Optimizer, whose CheckOverflow asks each gradient in turn
whether it holds an inf or a NaN and reads every answer back to the host (deepspeed/runtime/utils.py,
`has_overflow_serial`): with LoRA on every linear layer of a 28-layer model, 392 readbacks a step, each one
waiting for the GPU to drain, the GPU idle between them (bench/results/e2e_gpu_scale.md, the 2026-12-04 run (b4d5fbf)). The same
answer from one multi-tensor max-abs reduction (NaN propagates through it) and one readback. The step still skips
when the answer is yes, as DeepSpeed's own check would make it."""

from __future__ import annotations

import math
import types

import torch


def has_inf_or_nan(tensors: list[torch.Tensor]) -> bool:
    """Whether any of `tensors` holds an inf or a NaN; one readback."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return False
    peaks = torch._foreach_norm(tensors, ord=math.inf, dtype=torch.float32)  # max |x|: inf or NaN where any is
    return not bool(torch.stack(peaks).isfinite().all())


def check_in_one_readback(engine) -> bool:
    """Give `engine`'s optimizer this check where it runs DeepSpeed's per-tensor one on a single rank's view of
    the gradients (no model-parallel group, no expert parameters, no reduce-scatter: nothing DeepSpeed would
    all-reduce the answer over). -> whether it did."""
    checker = getattr(engine.optimizer, "overflow_checker", None)
    if checker is None or not hasattr(checker, "has_overflow_serial"):
        return False
    if checker.mpu is not None or checker.zero_reduce_scatter or checker.has_moe_params or \
            not getattr(engine, "enable_backward_allreduce", True):
        return False

    def has_overflow(self, params, has_moe_params=None):
        return has_inf_or_nan([p.grad for p in params if p.grad is not None])

    checker.has_overflow = types.MethodType(has_overflow, checker)
    return True
