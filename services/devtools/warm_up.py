"""The supervised warm-up step the examples and benchmarks share: token sequences right-padded, the loss on the
positions a mask marks (the model's own turns), the mean over them; one optimizer step."""

from __future__ import annotations


def sft_step(model, opt, seqs, masks, pad_id: int, device: str = "cpu", bf16: bool = False, micro: int | None = None):
    """-> the step's loss (detached). masks[i][t] = 1 where token t of sequence i is trained on. micro: sequences a
    forward (the same step's gradient, accumulated over the parts: a 1.5B model's float logits of 16 sequences of 2k
    tokens take 20 GB)."""
    import torch

    total = sum(sum(list(x)[1:]) for x in masks)  # the positions trained on (each predicts its token from the ones before)
    micro = micro or len(seqs)
    opt.zero_grad()
    loss = torch.zeros((), device=device)
    for i in range(0, len(seqs), micro):
        part, part_masks = seqs[i:i + micro], masks[i:i + micro]
        L = max(map(len, part))
        ids = torch.tensor([list(s) + [pad_id] * (L - len(s)) for s in part], device=device)
        m = torch.tensor([list(x) + [0] * (L - len(x)) for x in part_masks], dtype=torch.float32, device=device)[:, 1:]
        att = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in part], device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        part_loss = -(lp * m).sum() / total
        part_loss.backward()
        loss += part_loss.detach()
    opt.step()
    return loss
