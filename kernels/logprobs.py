"""Log-probs of chosen tokens, and entropy, without keeping [rows, vocab] logits alive.

`selective_logprobs(logits, ids, temperature)`: logits already exist (e.g. [chunk, V]).
`linear_logprobs(hidden, weight, ids, temperature, chunk)`: hidden [N, H] through the lm_head
`weight` [V, H] a chunk of rows at a time; backward recomputes each chunk's logits
(activation checkpointing), so at most `chunk × V` logits exist at once.

`linear_logprobs_loss(hidden, weight, ids, token_loss, ...)`: the fused form for losses that are a
sum of per-token terms (GRPO's are): each chunk's gradients are formed in forward, so logits are
computed once instead of twice.

The GRPO loss is not written here: learner/grpo.py's grpo_token_terms is the `token_loss` the learner hands to
`linear_logprobs_loss` (learner/logprobs.py), and triton_logprobs.py's linear_grpo_loss_triton its one fused form.

One name per op (Liger-Kernel's rule): `<op>` dispatches (Triton on CUDA, else the reference),
`<op>_reference` is plain PyTorch here, `<op>_triton` is the kernel in `triton_logprobs.py`; the
tests and benchmarks import the reference rather than rewriting it. A reference computes in the
precision of its inputs (float64 in, float64 out), which makes it the float64 oracle too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


def selective_logprobs_reference(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                                 with_entropy: bool = False):
    """logits [N, V] (any float dtype), ids [N] -> (logp [N] float32, entropy [N] float32 or None)."""
    z = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        with torch.no_grad():
            p = torch.softmax(z, dim=-1)
            ent = lse - (p * z).sum(-1)
    return logp, ent


def _chunk_logprobs(h, w, ids, temperature, with_entropy):
    logp, ent = selective_logprobs_reference(h @ w.t(), ids, temperature, with_entropy)
    return logp, (ent if ent is not None else logp.new_zeros(0))


def linear_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                              temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = False):
    """hidden [N, H], weight [V, H], ids [N] -> (logp [N] float32, entropy [N] or None).
    Each chunk's logits are recomputed in backward (checkpoint), never kept."""
    outs, ents = [], []
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, hidden.shape[0], chunk):
        args = (hidden[s:s + chunk], weight, ids[s:s + chunk], temperature, with_entropy)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if need_grad else _chunk_logprobs(*args)
        outs.append(lp)
        ents.append(ent)
    logp = torch.cat(outs) if outs else hidden.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat(ents) if with_entropy and ents else None)


def linear_logprobs_loss_reference(hidden, weight, ids, token_loss, temperature: float = 1.0, chunk: int = 1024,
                                   with_entropy: bool = False):
    """-> (loss = sum of token_loss(logp, 0, N), logp detached, entropy or None)."""
    logp, ent = linear_logprobs_reference(hidden, weight, ids, temperature, chunk, with_entropy)
    return token_loss(logp, 0, hidden.shape[0]).sum(), logp.detach(), ent


# Plain numbers, no config: the kernels know nothing of the job. These are the spec's defaults (the Triton loss's
# keyword defaults), which the job schema holds and the learner passes; tests/unit/test_loss.py keeps them equal.
EPSILON, EPSILON_HIGH, DELTA, BETA = 0.2, None, None, 0.0


def truncated_is(d, log_cap: float, log_min: float, masks: bool):
    """The truncated-importance-sampling weight from d = log(policy / sampler) (docs/grpo.md §4.6): exp(d) clamped
    to [log_min, log_cap] in log space (truncate), or 0 outside it (mask: exp(min(d, log_cap)) inside)."""
    if masks:
        return torch.where((d > log_cap) | (d < log_min), torch.zeros_like(d), torch.exp(d.clamp(max=log_cap)))
    return torch.exp(d.clamp(min=log_min, max=log_cap))


@dataclass(frozen=True)
class TisFromLogp:
    """On-policy truncated IS at token level, its weight taken from each token's own log-prob inside the loss's
    pass (a constant there): truncated_is(logp - sampler_logp, log(cap), log(clip_min)). mode: token_truncate or
    token_mask (the sequence modes need a whole sequence's log-probs first: a pass of their own)."""

    sampler_logp: torch.Tensor
    cap: float
    clip_min: float | None = None
    mode: str = "token_truncate"

    def __post_init__(self):
        if self.mode not in ("token_truncate", "token_mask"):
            raise ValueError(f"tandem.kernels.TisFromLogp: mode = {self.mode!r}; allowed: token_truncate, token_mask")
        if not self.cap or self.cap <= 0:
            raise ValueError(f"tandem.kernels.TisFromLogp: cap = {self.cap!r}; must be a positive number")

    @property
    def masks(self) -> bool:
        return self.mode == "token_mask"

    def log_bounds(self) -> tuple[float, float]:
        return math.log(self.cap), (-math.inf if self.clip_min is None else math.log(self.clip_min))

    def weight(self, logp, s: int, e: int):
        """The weight of tokens s..e from their log-probs (detached)."""
        dt = torch.promote_types(logp.dtype, torch.float32)
        d = logp.detach().to(dt) - self.sampler_logp[s:e].to(dt)
        return truncated_is(d, *self.log_bounds(), self.masks).to(logp.dtype)


def _triton_ready() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None and \
        importlib.util.find_spec("tandem.kernels.triton_logprobs") is not None


def triton_available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensor t (CUDA, and triton importable)."""
    return t.is_cuda and _triton_ready()


def selective_logprobs(logits, ids, temperature=1.0, with_entropy=False):
    if triton_available(logits):
        from tandem.kernels.triton_logprobs import selective_logprobs_triton

        return selective_logprobs_triton(logits, ids, temperature, with_entropy)
    return selective_logprobs_reference(logits, ids, temperature, with_entropy)


def linear_logprobs(hidden, weight, ids, temperature=1.0, chunk=1024, with_entropy=False):
    if triton_available(hidden):
        from tandem.kernels.triton_logprobs import linear_logprobs_triton

        return linear_logprobs_triton(hidden, weight, ids, temperature, chunk, with_entropy)
    return linear_logprobs_reference(hidden, weight, ids, temperature, chunk, with_entropy)


def linear_logprobs_loss(hidden, weight, ids, token_loss, temperature=1.0, chunk=1024, with_entropy=False):
    if triton_available(hidden):
        from tandem.kernels.triton_logprobs import linear_logprobs_loss_triton

        return linear_logprobs_loss_triton(hidden, weight, ids, token_loss, temperature, chunk, with_entropy)
    return linear_logprobs_loss_reference(hidden, weight, ids, token_loss, temperature, chunk, with_entropy)
