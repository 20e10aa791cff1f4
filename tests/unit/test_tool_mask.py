"""Multi-turn episodes' tool tokens are context, never actions: the loss mask a RolloutGroup carries reaches the
micro-batch, dapo counts only the model's tokens, and the loss has exactly zero gradient at, and no dependence on,
a tool token (every loss type, with TIS and KL)."""

import pytest
import torch

from tandem.learner.batch import Samples, collate
from tandem.learner.grpo import aggregate_loss, per_token_loss
from tests.helpers.learner import make_groups, with_tool_spans


def test_the_group_mask_reaches_the_micro_batch_and_the_dapo_count():
    groups = with_tool_spans(make_groups(3, 4, seed=5), seed=1)
    s = Samples.from_groups(groups)
    assert any(not m.all() for m in s.loss_masks), "no tool span was drawn"
    for mask_truncated in (False, True):
        mb = collate(s, range(len(s)), torch.zeros(len(s)), pad_id=0, mask_truncated=mask_truncated)
        for i in range(len(s)):
            want = s.loss_masks[i] & (bool(s.eos[i]) or not mask_truncated)
            got = mb["mask"][i, :len(s.completions[i])].numpy()
            assert (got == want).all() and not mb["mask"][i, len(s.completions[i]):].any()
        assert s.loss_mask_counts(range(len(s)), mask_truncated) == int(mb["mask"].sum())
    plain = Samples.from_groups(make_groups(3, 4, seed=5))  # no mask: every token the model's, as before
    assert plain.loss_mask_counts(range(len(plain)), False) == sum(len(c) for c in plain.completions)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_a_tool_token_has_zero_gradient_and_no_say_in_the_loss(loss_type):
    groups = with_tool_spans(make_groups(2, 4, seed=7), seed=2)
    s = Samples.from_groups(groups)
    adv = torch.randn(len(s), dtype=torch.float64)
    mb = collate(s, range(len(s)), adv, pad_id=0, mask_truncated=False)
    B, T = mb["mask"].shape
    V = 512
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(B, T, generator=gen, dtype=torch.float64) - 6

    def loss_of(old, sampler, logits=logits):
        logp = torch.log_softmax(logits, -1).gather(-1, mb["completion_ids"].unsqueeze(-1)).squeeze(-1)
        per = per_token_loss(logp, old, mb["advantages"].double(), mb["mask"], epsilon_high=0.28, delta=1.5, beta=0.1,
                             ref_logp=ref, sampler_logp=sampler, tis_cap=1.5)
        return aggregate_loss(per, mb["mask"], loss_type, max_completion_length=16)

    old = (mb["sampler_logp"].double() + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64))
    loss = loss_of(old, mb["sampler_logp"].double())
    loss.backward()
    tool = ~mb["mask"] & (torch.arange(T) < torch.tensor([len(c) for c in s.completions])[:, None])
    assert tool.any() and mb["mask"].any()
    assert logits.grad[tool].abs().max().item() == 0.0  # exactly: not small, zero
    assert logits.grad[mb["mask"]].abs().max().item() > 0.0
    noise = torch.where(tool, torch.full((B, T), 7.0, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64))
    with torch.no_grad():
        moved = loss_of(old + noise, mb["sampler_logp"].double() - noise)  # a tool token's old and sampler log-probs
        assert moved.item() == loss.item()
