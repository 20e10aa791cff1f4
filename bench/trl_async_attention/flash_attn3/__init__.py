"""A local stand-in for the Hugging Face Hub kernel `kernels-community/flash-attn3`, which TRL's AsyncGRPOTrainer
loads for its packed attention (trl/experimental/async_grpo/packing.py: `get_kernel(...).flash_attn_varlen_func`).
Where the Hub cannot be reached, bench/trl_candidates.py points Hugging Face's `kernels` package at this folder
(LOCAL_KERNELS, that package's own override), so TRL's trainer runs unchanged. On a GPU it computes with torch's
variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`: FlashAttention-2 kernels built into
torch, with their backward), not FlashAttention-3: attention is slower by what FA3 gains on Hopper, which the
benchmark's row says. On a CPU: `reference_varlen_attention`, one masked attention per segment.

The contract is FlashAttention's varlen one: q (Tq, H, D), k and v (Tk, Hkv, D) with H a multiple of Hkv (grouped
queries), segments by cumulative offsets, and with `causal` a query attends the keys up to its own position counted
from the segment's end (bottom-right alignment, where a segment has more keys than queries)."""

import inspect

import torch
import torch.nn.functional as F


def reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                               window_size=(-1, -1)):
    """Each segment's attention on its own, masked as FlashAttention masks it."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    left, right = (window_size[0], 0) if causal else window_size
    for s in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        k0, k1 = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
        qs, ks, vs = q[q0:q1], k[k0:k1].repeat_interleave(group, 1), v[k0:k1].repeat_interleave(group, 1)
        i = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)  # query's position among keys
        j = torch.arange(k1 - k0, device=q.device)[None, :]
        allowed = torch.ones_like(i * j, dtype=torch.bool)
        if right >= 0:
            allowed &= j <= i + right
        if left >= 0:
            allowed &= j >= i - left
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                           attn_mask=allowed, scale=softmax_scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"scale": softmax_scale}
    left, right = (window_size[0], 0) if causal else window_size
    if "window_size" in params:
        kw["window_size"] = (left, right)
    elif left >= 0 or right not in (-1, 0) or (right == 0) != causal:
        raise NotImplementedError(f"flash_attn_varlen_func: window_size {window_size} needs a torch whose varlen_attn "
                                  f"takes window_size (this one takes {list(params)})")
    else:
        kw["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # each key/value head repeated for its group of query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), **kw)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, **unused):
    if softcap:
        raise NotImplementedError(f"flash_attn_varlen_func: softcap {softcap} is not supported by this stand-in")
    if q.is_cuda:
        return _torch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                             tuple(window_size))
    return reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, tuple(window_size))
