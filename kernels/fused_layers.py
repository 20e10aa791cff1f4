"""Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE in a Llama-family model's layers (`model.use_liger_kernel`).

A decoder's norms and MLP activation are a dozen elementwise passes per layer in transformers' eager code (float32
casts, square, mean, rsqrt, two multiplies; SiLU then a multiply), forward and again backward: on the 1.5B
long-tail learner `aten::mul` and `aten::copy_` were a fifth of the GPU time (bench/results/learner_gpu.md, the run of
2026-12-03). Liger fuses each into one kernel. This is what transformers' Trainer patches for `use_liger_kernel=True`
(liger_kernel.transformers.monkey_patch), done per module instance instead: Liger's `apply_liger_kernel_to_*`
also swaps the classes in transformers' modules, which would reach every model built later in the process
(a frozen reference, the padding-free probe on the CPU). A patched layer takes Liger's kernel only for a CUDA
input and its own forward otherwise. RoPE is a function transformers' attention calls by its module's global name,
so that name becomes a dispatcher (`_rope_dispatch`) that takes Liger's kernel only inside a patched attention's
forward with CUDA inputs, and transformers' own function everywhere else (one kernel each way instead of ~8
elementwise passes over q and k per layer)."""

from __future__ import annotations

import contextvars
import sys
import types

import torch

# norms computed as Llama's (float32 variance, the weight applied in the input's dtype: Liger's "llama" casting)
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
SWIGLU_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
ROPE_ATTENTIONS = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention"})
SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's; transformers 5's ACT2FN["silu"]


def liger_missing() -> str | None:
    """Why Liger's kernels cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (Liger's kernels are Triton)"
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
        import liger_kernel.transformers.rope  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not importable ({e}; pip install liger-kernel)"
    return None


def fuse_layers(model) -> int:
    """Patch every Llama-style RMSNorm, SwiGLU MLP and attention (its RoPE) of `model` (a plain or peft model) -> how
    many."""
    n = 0
    for mod in model.modules():
        name = type(mod).__name__
        if name in LLAMA_NORMS and hasattr(mod, "variance_epsilon"):
            mod._own_forward, mod.forward = mod.forward, types.MethodType(_norm_forward, mod)
            n += 1
        elif name in SWIGLU_MLPS and type(getattr(mod, "act_fn", None)).__name__ in SILU:
            mod._own_forward, mod.forward = mod.forward, types.MethodType(_mlp_forward, mod)
            n += 1
        elif name in ROPE_ATTENTIONS and _rope_dispatch(sys.modules[type(mod).__module__]):
            mod._own_forward, mod.forward = mod.forward, types.MethodType(_attention_forward, mod)
            n += 1
    return n


_LIGER_ROPE = contextvars.ContextVar("tandem_liger_rope", default=False)  # inside a patched attention's forward


def _rope_dispatch(module) -> bool:
    """`module.apply_rotary_pos_emb` (a transformers modeling module's) -> a dispatcher, once: Liger's RoPE within a
    patched attention's forward for CUDA inputs called as (q, k, cos, sin), the module's own function otherwise.
    False where the module has no such function."""
    own = getattr(module, "apply_rotary_pos_emb", None)
    if own is None:
        return False
    if getattr(own, "_tandem_dispatch", False):
        return True

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _LIGER_ROPE.get() and q.is_cuda and not args and not kwargs:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            return liger_rotary_pos_emb(q, k, cos, sin)
        return own(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._tandem_dispatch = True
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _attention_forward(self, *args, **kwargs):
    token = _LIGER_ROPE.set(True)
    try:
        return self._own_forward(*args, **kwargs)
    finally:
        _LIGER_ROPE.reset(token)


def _norm_forward(self, x):
    if not x.is_cuda:
        return self._own_forward(x)
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _mlp_forward(self, x):
    if not x.is_cuda:
        return self._own_forward(x)
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))
