"""The supervised warm-up step the examples and benchmarks share: token sequences right-padded, the loss on the
positions a mask marks (the model's own turns), the mean over them; one optimizer step."""

from __future__ import annotations


def sft_step(model, opt, seqs, masks, pad_id: int, device: str = "cpu", bf16: bool = False):
    """-> the step's loss (detached). masks[i][t] = 1 where token t of sequence i is trained on."""
    import torch

    L = max(map(len, seqs))
    ids = torch.tensor([list(s) + [pad_id] * (L - len(s)) for s in seqs], device=device)
    m = torch.tensor([list(x) + [0] * (L - len(x)) for x in masks], dtype=torch.float32, device=device)[:, 1:]
    att = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs], device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(lp * m).sum() / m.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()
