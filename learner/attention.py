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

from tandem.learner.model import decoder_and_head

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


def keeps_sequences_apart(model, rtol: float = 5e-2) -> bool:
    """A probe of a causal LM loaded with NAME: two short sequences packed into one row give the hidden states
    each gives alone. False where the model's forward drops the cu_seq_lens keywords (its attention would then run
    across the whole row)."""
    decoder = decoder_and_head(model)[0]
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    dev = next(decoder.parameters()).device
    ids, pos = torch.cat(seqs)[None].to(dev), torch.cat([torch.arange(len(x)) for x in seqs])[None].to(dev)
    cu = cu_seq_lens(map(len, seqs)).to(dev)
    with torch.no_grad():
        packed = decoder(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                         max_length_q=3, max_length_k=3).last_hidden_state[0, 3:].float()
        alone = decoder(input_ids=seqs[1][None].to(dev), use_cache=False).last_hidden_state[0].float()
    return bool((packed - alone).abs().max() <= rtol * alone.abs().max() + 1e-4)


def _mask(*args, attention_mask=None, **kwargs):
    """No mask for a packed row (cu_seq_lens keep its sequences apart); a padded batch gets SDPA's."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, max_length_q=None, sliding_window=None, **kwargs):
    """transformers' attention-function contract: query [1, Hq, L, D], key/value [1, Hkv, L, D] ->
    ([1, L, Hq, D], None). Causal within each packed sequence, as `cu_seq_lens_q` delimits them; a batch that is
    not packed (no cu_seq_lens_q) goes to transformers' SDPA with its mask."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"attention {NAME!r}: cu_seq_lens_q given for a batch of {query.shape[0]} rows; a packed "
                         f"micro-batch is one row (learner/batch.py's collate)")
    if dropout:
        raise ValueError(f"attention {NAME!r}: attention dropout {dropout} is not supported (0 is)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, H, D]
    if q.is_cuda:
        out = _flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling, sliding_window)
    else:
        out = _per_sequence_sdpa(q, k, v, cu_seq_lens_q, scaling, sliding_window)
    return out[None], None


def _per_sequence_sdpa(q, k, v, cu, scaling, sliding_window=None):
    """Causal attention per sequence; a sliding window lets query i see keys i - window < j <= i (transformers')."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    lengths = torch.diff(cu).tolist()
    parts = []
    # split, not slices: a slice's backward writes its gradient into zeros the size of the whole row (one
    # per sequence), split's concatenates once
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        i = torch.arange(len(qs), device=q.device)
        d = i[:, None] - i[None, :]
        mask = dict(is_causal=True) if sliding_window is None else dict(attn_mask=(d >= 0) & (d < sliding_window))
        parts.append(F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                    scale=scaling, **mask).transpose(0, 1))
    return torch.cat(parts)


@functools.cache
def _varlen_params() -> frozenset:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(q, k, v, cu, max_len, scaling, sliding_window=None):
    """torch's varlen_attn, whose keywords moved between releases (2.10: is_causal; later: window_size, scale,
    enable_gqa): causal either way; grouped KV heads repeated where the release has no enable_gqa."""
    from torch.nn.attention.varlen import varlen_attn

    params, kw = _varlen_params(), {}
    if "window_size" in params:
        kw["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    elif sliding_window is None:
        kw["is_causal"] = True
    else:
        raise ValueError(f"model.padding_free: the model attends within a sliding window of {sliding_window} and this "
                         f"torch's varlen_attn has no window_size (torch >= 2.11 has); set model.padding_free: false")
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
