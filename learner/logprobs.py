"""Per-token log-probs of completion tokens: one forward over prompt + completion, hidden
states of the completion positions only, lm_head in row chunks (kernels), logits / temperature.

`completion_grpo_loss` is the training path: only real completion tokens go through the lm_head,
and the GRPO loss's gradient is formed chunk by chunk in the same pass (Triton on CUDA)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tandem.kernels.logprobs import (
    TisFromLogp,
    linear_logprobs,
    linear_logprobs_loss,
    selective_logprobs,
    triton_available,
)
from tandem.learner.batch import mask_positions
from tandem.learner.grpo import grpo_token_terms
from tandem.learner.model import decoder_and_head


def _decoded(model, batch):
    """-> (the decoder's last hidden states: [1, L, H] for a packed row, [B, P + T, H] padded; lm_head module)."""
    decoder, head = decoder_and_head(model)
    if "gather" in batch:  # padding-free: one packed row, attention within each sequence (learner/attention.py)
        cu, n = batch["cu_seq_lens"], batch["max_length"]
        out = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=n, max_length_k=n)
    else:
        out = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"], use_cache=False)
    return out.last_hidden_state, head


def _hidden(model, batch):
    """-> (hidden [B, T, H] predicting each completion token, lm_head module)."""
    last, head = _decoded(model, batch)
    if "gather" in batch:
        return last[0][batch["gather"]], head
    T = batch["completion_ids"].shape[1]
    return last[:, -T - 1:-1], head  # position t predicts token t + 1


def _hidden_at(model, batch, idx):
    """-> (hidden [n, H] predicting the completion tokens at flat [B * T] positions `idx`, lm_head module), taken
    straight from the decoder's output: no [B, T, H] copy first, whose backward, on a packed row, would add each
    row's padding (thousands of entries pointing at one position) into that position one after another."""
    last, head = _decoded(model, batch)
    if "gather" in batch:
        return last[0].index_select(0, batch["gather"].reshape(-1).index_select(0, idx)), head
    T = batch["completion_ids"].shape[1]
    _, S, H = last.shape
    row = torch.div(idx, T, rounding_mode="floor")
    return last.reshape(-1, H).index_select(0, row * S + (S - T - 1) + (idx - row * T)), head  # t predicts t + 1


def _plain_weight(head):
    """A bias-free nn.Linear head's weight, else None (LoRA on the head: call the module)."""
    return head.weight if isinstance(head, torch.nn.Linear) and head.bias is None else None


@contextlib.contextmanager
def _full_weight(head):
    """Under ZeRO-3 the head's weight is a partition: gather it and keep a detached copy, which the
    chunked backward can still read after the gather is released (frozen head; a head that trains
    under ZeRO-3 goes through the module, whose hooks own its gradient)."""
    w = _plain_weight(head)
    if w is None or getattr(w, "ds_id", None) is None:
        yield w
    elif w.requires_grad:
        yield None
    else:
        import deepspeed

        with deepspeed.zero.GatheredParameters([w], modifier_rank=None):
            full = w.detach().clone()
        yield full


def _module_logprobs(head, hidden, ids, temperature, chunk, with_entropy):
    parts = [selective_logprobs(head(h), t, temperature, with_entropy) for h, t in zip(hidden.split(chunk),
                                                                                      ids.split(chunk))]
    logp = torch.cat([p[0] for p in parts]) if parts else hidden.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat([p[1] for p in parts]) if with_entropy and parts else None)


def _head_logprobs(head, w, hidden, ids, temperature, chunk, with_entropy=False):
    """Log-probs of `ids` from `hidden` [N, H]: the chunked kernel on a plain weight `w`, else the module."""
    if w is not None:
        return linear_logprobs(hidden, w, ids, temperature, chunk, with_entropy)
    return _module_logprobs(head, hidden, ids, temperature, chunk, with_entropy)


def completion_logprobs(model, batch, temperature: float, *, chunk: int = 1024, with_entropy: bool = False,
                        masked: bool = False):
    """batch: input_ids/attention_mask/position_ids [B, P+T], completion_ids [B, T].
    `masked`: only the tokens of batch["mask"] through the lm_head, 0 elsewhere (what the learner's old and
    reference passes need: a packed micro-batch's [B, T] is mostly padding past its short completions).
    -> (logp [B, T] float32, entropy [B, T] or None)."""
    if masked:
        B, T = batch["completion_ids"].shape
        idx = masked_positions(batch)
        if idx.numel() == 0:  # zeros, still on the graph: a training pass runs backward through them
            last, _ = _decoded(model, batch)
            zeros = torch.zeros(B, T, device=last.device)
            return zeros + (last.sum() * 0.0).float(), (zeros if with_entropy else None)
        h, head = _hidden_at(model, batch, idx)
        with _full_weight(head) as w:
            logp, ent = _head_logprobs(head, w, h, batch["completion_ids"].reshape(-1)[idx], temperature, chunk,
                                       with_entropy)
        return _scatter(logp, idx, B, T), (_scatter(ent, idx, B, T) if ent is not None else None)
    hidden, head = _hidden(model, batch)
    B, T, H = hidden.shape
    h, ids = hidden.reshape(-1, H), batch["completion_ids"].reshape(-1)
    with _full_weight(head) as w:
        logp, ent = _head_logprobs(head, w, h, ids, temperature, chunk, with_entropy)
    return logp.view(B, T), (ent.view(B, T) if ent is not None else None)


def masked_positions(batch) -> torch.Tensor:
    """Flat [B * T] positions of batch["mask"]'s tokens: "masked_at" where learner/batch.py's to_device found them on
    the host (so the forward reads nothing back from the GPU), else found here."""
    at = batch.get("masked_at")
    return at if at is not None else mask_positions(batch["mask"])


def _scatter(x, idx, B: int, T: int):
    """Per-token values at flat positions `idx` -> [B, T], 0 elsewhere (differentiable in x)."""
    return torch.zeros(B * T, dtype=x.dtype, device=x.device).index_copy(0, idx, x).view(B, T)


def completion_grpo_loss(model, batch, temperature: float, token_weight, *, old_logp=None, ref_logp=None, tis=None,
                         tis_from=None, chunk=None, **terms):
    """The micro-batch's GRPO loss, sum_t token_weight * loss_t (token_weight [B, T] from
    learner/forwards.py's plan_weights), token-level ratios. [B, T] inputs; old_logp None = on-policy. `terms`: the
    per-token terms' scalars (learner/grpo.py's token_term_params: epsilon, epsilon_high, delta, beta), passed as
    they are to learner/grpo.py's grpo_token_terms (or the Triton kernel on CUDA), whose defaults are the spec's.
    `tis_from`: on-policy with truncated importance sampling, the weight taken from this pass's own log-probs:
    a kernels.TisFromLogp (sampler_logp [B, T]; token modes) inside the loss's own lm_head pass, or a function
    `tis_from(logp [B, T]) -> tis [B, T]` (sequence modes) after an lm_head pass of its own, rather than from a
    separate forward of the whole model.
    -> (loss, logp [B, T] detached, entropy [B, T]; both 0 where masked)."""
    B, T = batch["completion_ids"].shape
    idx = masked_positions(batch)  # real completion tokens only
    if idx.numel() == 0:  # nothing to learn from, but DeepSpeed still needs a graph to run backward on
        last, _ = _decoded(model, batch)
        zeros = torch.zeros(B, T, device=last.device)
        return last.sum() * 0.0, zeros, zeros
    h, head = _hidden_at(model, batch, idx)
    ids = batch["completion_ids"].reshape(-1)[idx]
    pick = lambda x: None if x is None else x.reshape(-1)[idx].float()
    full = lambda x: _scatter(x.float(), idx, B, T)
    in_pass = isinstance(tis_from, TisFromLogp)
    with _full_weight(head) as w:
        if tis_from is not None and not in_pass:
            with torch.no_grad():
                tis = tis_from(full(_head_logprobs(head, w, h, ids, temperature, chunk or 1024)[0]))
        adv = batch["advantages"].float().unsqueeze(-1).expand(B, T).reshape(-1)[idx]
        kw = dict(terms, ref_logp=pick(ref_logp), tis=pick(tis))
        if in_pass:
            kw["tis_from"] = dataclasses.replace(tis_from, sampler_logp=pick(tis_from.sampler_logp))
        if w is not None:
            loss, logp, ent = linear_grpo_loss(h, w, ids, pick(old_logp), adv, pick(token_weight),
                                               temperature=temperature, chunk=chunk, **kw)
        else:  # LoRA on the head, or a head with a bias: through the module, per chunk
            logp, ent = _module_logprobs(head, h, ids, temperature, chunk or 1024, True)
            loss = grpo_token_terms(pick(old_logp), adv, pick(token_weight), **kw)(logp, 0, logp.shape[0]).sum()
            logp = logp.detach()
    return loss, full(logp), full(ent)


def linear_grpo_loss(h, w, ids, old_logp, adv, token_weight, *, temperature: float, chunk, **terms):
    """The GRPO loss of flat tokens through the lm_head weight w: on CUDA the Triton kernel (the loss's one fused
    form), elsewhere the chunked torch path over grpo_token_terms. -> (loss, logp detached, entropy)."""
    if triton_available(h):
        from tandem.kernels.triton_logprobs import linear_grpo_loss_triton

        return linear_grpo_loss_triton(h, w, ids, old_logp, adv, token_weight, temperature=temperature, chunk=chunk,
                                       with_entropy=True, **terms)
    return linear_logprobs_loss(h, w, ids, grpo_token_terms(old_logp, adv, token_weight, **terms), temperature,
                                chunk or 1024, with_entropy=True)
