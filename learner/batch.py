"""Generation batch -> padded tensors. Rows are (prompt, generation) samples in the batch plan's
order; prompts left-padded, completions right-padded, so completion positions are the last T."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.core.protocol import RolloutGroup
from tandem.learner.attention import cu_seq_lens
from tandem.learner.forwards import weights_tensor


@dataclass
class Samples:
    """The whole generation batch, flattened: sample i = group i // G, completion i % G."""

    prompts: list[np.ndarray]
    completions: list[np.ndarray]
    sampler_logprobs: list[np.ndarray]
    eos: np.ndarray  # bool [N]
    rewards: np.ndarray  # float32 [N, F]
    versions: np.ndarray  # int [N]: the version each sample started on
    # bool, per completion token: the model's own (False: a tool's, the environment's) and within the staleness bound
    loss_masks: list[np.ndarray]
    origins: list[tuple[int, int]] = field(default_factory=list)  # per sample: its group's (group_id, dataset index)
    token_versions: list[np.ndarray] = field(default_factory=list)  # int32, per completion token: the version that sampled it
    stale_tokens: int = 0  # the model's tokens masked for being too old for the weights that train on them

    @classmethod
    def from_groups(cls, groups: list[RolloutGroup], version: int | None = None, max_lag: int | None = None
                    ) -> Samples:
        """version, max_lag: the weights that train on these groups and the token bound (cluster.max_token_lag): a token
        sampled more than max_lag versions before `version` leaves the loss (token_bound; docs/grpo.md §6)."""
        p, c, s, e, r, v, m, o, tv = [], [], [], [], [], [], [], [], []
        stale = 0
        for g in groups:
            o += [(g.group_id, g.index)] * g.num_generations
            for k in range(g.num_generations):
                p.append(g.prompt_ids)
                c.append(g.completion(k))
                s.append(g.completion_logprobs(k))
                tv.append(g.completion_versions(k))
                mask = g.completion_loss_mask(k)
                if version is not None and max_lag is not None:
                    fresh = token_bound(tv[-1], version, max_lag)
                    stale += int((mask & ~fresh).sum())
                    mask = mask & fresh
                m.append(mask)
                v.append(g.version)
            e.append(g.eos)
            r.append(g.rewards)
        return cls(p, c, s, np.concatenate(e), np.concatenate(r).astype(np.float32), np.asarray(v), m, o, tv, stale)

    def __len__(self) -> int:
        return len(self.completions)

    def trained(self, i: int, mask_truncated: bool) -> bool:
        """Sample i enters the loss at all (mask_truncated_completions drops one that never emitted EOS)."""
        return bool(self.eos[i]) or not mask_truncated

    def loss_mask_counts(self, rows, mask_truncated: bool) -> int:
        """The tokens the loss sees in these rows: the model's own, of the samples trained (dapo's count)."""
        return int(sum(self.loss_masks[i].sum() for i in rows if self.trained(i, mask_truncated)))


def token_bound(versions: np.ndarray, version: int, max_lag: int) -> np.ndarray:
    """bool: the tokens the weights of `version` may train on, those sampled at most max_lag versions before."""
    return version - np.asarray(versions) <= max_lag


def collate(s: Samples, rows, advantages: torch.Tensor, *, pad_id: int, mask_truncated: bool,
            padding_free: bool = False, weights: list[torch.Tensor] | None = None) -> dict:
    """The rows as one micro-batch: [B, P + T] padded tensors, or (padding_free) every sequence packed into one row
    [1, L] (positions restarting at each sequence) with `gather` [B, T], the packed position whose hidden state
    predicts each completion token. The completion tensors ([B, T]) are the same either way; `weights` (one vector
    per row over its completion, learner/forwards.py) become "weights" [B, T]."""
    rows = list(rows)
    T = max(max(len(s.completions[i]) for i in rows), 1)
    extra = {} if weights is None else {"weights": weights_tensor(weights, T)}
    if padding_free:
        return _packed(s, rows, T, advantages, pad_id=pad_id, mask_truncated=mask_truncated) | extra
    P, B = max(len(s.prompts[i]) for i in rows), len(rows)
    # torch.tensor, not as_tensor: the rows arrive read-only from Ray's object store, which as_tensor warns of
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    for b, i in enumerate(rows):
        pr, c = s.prompts[i], s.completions[i]
        ids[b, P - len(pr):P] = torch.tensor(pr, dtype=torch.long)
        attn[b, P - len(pr):P + len(c)] = 1
        ids[b, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # positions as an unpadded sequence (what vLLM sees)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
            **_completion_tensors(s, rows, T, pad_id, mask_truncated), "advantages": advantages[rows].float()} | extra


def loss_mask(s: Samples, rows, mask_truncated: bool) -> torch.Tensor:
    """[B, T] the tokens of these rows the loss sees (T their longest completion), as collate's "mask"."""
    rows = list(rows)
    T = max(max(len(s.completions[i]) for i in rows), 1)
    return _completion_tensors(s, rows, T, 0, mask_truncated)["mask"]


def _completion_tensors(s: Samples, rows: list, T: int, pad_id: int, mask_truncated: bool) -> dict:
    B = len(rows)
    comp = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    samp = torch.zeros((B, T), dtype=torch.float32)
    for b, i in enumerate(rows):
        c = s.completions[i]
        comp[b, :len(c)] = torch.tensor(c, dtype=torch.long)
        samp[b, :len(c)] = torch.tensor(s.sampler_logprobs[i], dtype=torch.float32)
        if s.trained(i, mask_truncated):
            mask[b, :len(c)] = torch.tensor(s.loss_masks[i], dtype=torch.bool)
    return {"completion_ids": comp, "mask": mask, "sampler_logp": samp}


def _packed(s: Samples, rows: list, T: int, advantages: torch.Tensor, *, pad_id: int, mask_truncated: bool) -> dict:
    seqs = [np.concatenate([s.prompts[i], s.completions[i]]) for i in rows]
    ids = torch.as_tensor(np.concatenate(seqs), dtype=torch.long)[None]
    pos = torch.cat([torch.arange(len(x)) for x in seqs])[None]  # transformers masks attention per sequence
    gather = torch.zeros((len(rows), T), dtype=torch.long)
    start = 0
    for b, i in enumerate(rows):
        p, c = len(s.prompts[i]), len(s.completions[i])
        gather[b, :c] = start + p - 1 + torch.arange(c)  # position t predicts token t + 1
        gather[b, c:] = start  # padding: any position of the row (masked)
        start += p + c
    return {"input_ids": ids, "position_ids": pos, "gather": gather, "cu_seq_lens": cu_seq_lens(map(len, seqs)),
            "max_length": max(map(len, seqs)),
            **_completion_tensors(s, rows, T, pad_id, mask_truncated), "advantages": advantages[rows].float()}


def real_tokens(mb: dict) -> int:
    """The tokens a micro-batch's forward computes that are not padding."""
    return int(mb["input_ids"].numel()) if "gather" in mb else int(mb["attention_mask"].sum())


def attention_pairs(mb: dict) -> int:
    """Σ s² over the micro-batch's sequences (s: a sequence's real tokens): the (query, key) pairs its attention
    scores, as FLOP counts take them (learner/layout.py: training_flops)."""
    s = mb["cu_seq_lens"].diff() if "gather" in mb else mb["attention_mask"].sum(-1)
    return int((s.long() ** 2).sum())


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat [B * T] positions of a [B, T] mask's tokens."""
    return mask.reshape(-1).nonzero().squeeze(-1)


def to_device(mb: dict, device) -> dict:
    """A collated micro-batch (built on the host) on the model's device, with "masked_at": the flat positions of its
    mask's tokens, found here on the host (found on the GPU, each forward would wait for the GPU to drain first;
    learner/logprobs.py: masked_positions)."""
    at = {"masked_at": mask_positions(mb["mask"])} if "mask" in mb else {}
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in (mb | at).items()}
