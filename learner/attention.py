"""Variable-length attention for the padding-free learner (`model.padding_free`): a micro-batch's sequences are
packed into one row, and attention runs within each sequence only, over the real tokens (no T x T mask over the
whole row). Registered with transformers' AttentionInterface under NAME, as its flash_attention_2 path takes the
same inputs (cu_seq_lens_q / max_length_q, transformers' FlashAttentionKwargs), so the model's own forward calls
it; on CUDA the kernel is torch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention; no flash-attn wheel
needed), elsewhere one causal SDPA per sequence."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "tandem_varlen"


def cu_seq_lens(lengths) -> torch.Tensor:
    """[N + 1] int32 offsets of N packed sequences (FlashAttention's cu_seqlens)."""
    lengths = list(lengths)
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.as_tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def register() -> str:
    """NAME in transformers' attention and mask registries (idempotent); the name to load a model with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def _mask(*args, attention_mask=None, **kwargs):
    """No mask for a packed row (cu_seq_lens keep its sequences apart); a padded batch gets SDPA's."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention-function contract: query [1, Hq, L, D], key/value [1, Hkv, L, D] ->
    ([1, L, Hq, D], None). Causal within each packed sequence, as `cu_seq_lens_q` delimits them; a batch that is
    not packed (no cu_seq_lens_q) goes to transformers' SDPA with its mask."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"attention {NAME!r}: cu_seq_lens_q given for a batch of {query.shape[0]} rows; a packed "
                         f"micro-batch is one row (learner/batch.py's collate)")
    if dropout:
        raise ValueError(f"attention {NAME!r}: attention dropout {dropout} is not supported (0 is)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, H, D]
    if q.is_cuda:
        out = _flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _per_sequence_sdpa(q, k, v, cu_seq_lens_q, scaling)
    return out[None], None


def _per_sequence_sdpa(q, k, v, cu, scaling):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bounds = cu.tolist()
    parts = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                            is_causal=True, scale=scaling).transpose(0, 1)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts)


@functools.cache
def _varlen_params() -> frozenset:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(q, k, v, cu, max_len, scaling):
    """torch's varlen_attn, whose keywords moved between releases (2.10: is_causal; later: window_size, scale,
    enable_gqa): causal either way; grouped KV heads repeated where the release has no enable_gqa."""
    from torch.nn.attention.varlen import varlen_attn

    params, kw = _varlen_params(), {}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"attention {NAME!r}: this torch's varlen_attn has no scale; the model needs {scaling}")
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    cu = cu.to(q.device, torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
