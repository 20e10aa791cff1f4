"""One LoRA linear layer as one autograd op: y = x W^T + b + s (x A^T) B^T.

peft's `lora.Linear` computes the same as four modules' worth of ops: the base matmul, lora_A, lora_B, then
a full-size scale and a full-size add (and, backward, a full-size scale and a full-size add of the two input
gradients). Here the scale and the adds ride in the GEMMs' epilogues (`addmm`'s alpha and beta): 3 kernels
forward and 4-5 backward instead of ~5 and ~9, and four full-size elementwise passes less per layer. On a
0.5B model with LoRA on every linear layer that is ~5,000 launches and ~150 ms of GPU time less per training
step (bench/results/learner_gpu.md). Plain PyTorch, so CPU and GPU alike.

`lora_linear(x, weight, bias, lora_a, lora_b, scale)`: x [..., in], weight [out, in], bias [out] or None,
lora_a [r, in], lora_b [out, r]. Gradients for whichever inputs require them (LoRA: x, lora_a, lora_b).
"""

from __future__ import annotations

import torch


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ lora_a.t()
        y = torch.addmm(bias, x2, weight.t()) if bias is not None else x2 @ weight.t()
        y.addmm_(h, lora_b.t(), alpha=scale)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, h)
        ctx.scale, ctx.x_shape = scale, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        s = ctx.scale
        g = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        gx = gw = gbias = ga = gb = None
        gh = g @ lora_b if (need_x or need_a) else None  # [n, r], unscaled
        if need_x:
            gx = (g @ weight).addmm_(gh, lora_a, alpha=s).view(ctx.x_shape)
        if need_w:
            gw = g.t() @ x2
        if need_bias:
            gbias = g.sum(0)
        if need_a:
            ga = (gh.t() @ x2).mul_(s)  # [r, in]: small, the scale is cheap here
        if need_b:
            gb = (g.t() @ h).mul_(s)  # [out, r]
        return gx, gw, gbias, ga, gb, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    return _LoRALinear.apply(x, weight, bias, lora_a, lora_b, float(scale))


def lora_linear_reference(x, weight, bias, lora_a, lora_b, scale):
    """What peft's lora.Linear computes (dropout 0), op by op."""
    return torch.nn.functional.linear(x, weight, bias) + (x @ lora_a.t() @ lora_b.t()) * scale
