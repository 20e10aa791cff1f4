"""Per-token log-probs of completion tokens: one forward over prompt + completion, hidden
states of the completion positions only, lm_head in row chunks (kernels), logits / temperature."""

from __future__ import annotations

import torch
from tandem.kernels.logprobs import linear_logprobs
from tandem.learner.model import decoder_and_head


def completion_logprobs(model, batch, temperature: float, *, chunk: int = 1024, with_entropy: bool = False):
    """batch: input_ids/attention_mask/position_ids [B, P+T], completion_ids [B, T].
    -> (logp [B, T] float32, entropy [B, T] or None)."""
    decoder, head = decoder_and_head(model)
    T = batch["completion_ids"].shape[1]
    out = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"], use_cache=False)
    hidden = out.last_hidden_state[:, -T - 1:-1]  # position t predicts token t + 1
    B, _, H = hidden.shape
    ids = batch["completion_ids"].reshape(-1)
    if isinstance(head, torch.nn.Linear) and head.bias is None:
        logp, ent = linear_logprobs(hidden.reshape(-1, H), head.weight, ids, temperature, chunk, with_entropy)
    else:  # lm_head wrapped (e.g. LoRA on lm_head): plain chunked path through the module
        from tandem.kernels.logprobs import selective_logprobs

        parts = [selective_logprobs(head(h), t, temperature, with_entropy)
                 for h, t in zip(hidden.reshape(-1, H).split(chunk), ids.split(chunk))]
        logp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if with_entropy else None
    return logp.view(B, T), (ent.view(B, T) if ent is not None else None)
