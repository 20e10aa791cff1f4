"""The learner's fused loss path (completion_grpo_loss: real tokens only, gradient formed in the
lm_head pass; Triton on CUDA) against the plain one (completion_logprobs, per_token_loss,
aggregate_loss) on a small random transformers model, left-padded prompts and masked tokens."""

import pytest
import torch

from tandem.learner.grpo import aggregate_loss, per_token_loss, tis_weight, token_weights
from tandem.learner.logprobs import completion_grpo_loss, completion_logprobs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_lm(tie):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(DEV)


def batch(B=4, P=5, T=7, V=300):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, P + T), generator=g)
    attn = torch.ones(B, P + T, dtype=torch.long)
    attn[1, :2] = 0  # left padding of a shorter prompt
    ids[1, :2] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[3] = False  # a completion with nothing to learn from
    out = dict(input_ids=ids, attention_mask=attn, position_ids=pos, completion_ids=ids[:, P:], mask=mask,
               advantages=torch.randn(B, generator=g), sampler_logp=-torch.rand(B, T, generator=g) * 5)
    return {k: v.to(DEV) for k, v in out.items()}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_fused_path_equals_plain_path(tie, loss_type):
    model, mb = tiny_lm(tie), batch()
    with torch.no_grad():
        old = completion_logprobs(model, mb, 0.9)[0] + 0.2 * torch.randn(4, 7, device=DEV)
    kw = dict(epsilon=0.2, epsilon_high=0.28, delta=1.6, beta=0.05)
    ref = old - 0.1
    tis = tis_weight(old, mb["sampler_logp"], mb["mask"], 2.0)

    per_kw = dict(kw, ref_logp=ref, sampler_logp=mb["sampler_logp"], tis_cap=2.0)
    logp, _ = completion_logprobs(model, mb, 0.9)
    want = aggregate_loss(per_token_loss(logp, old, mb["advantages"], mb["mask"], **per_kw), mb["mask"], loss_type,
                          max_completion_length=7)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    w = token_weights(mb["mask"], loss_type, max_completion_length=7)
    loss, lp, ent = completion_grpo_loss(model, mb, 0.9, w, old_logp=old, ref_logp=ref, tis=tis, chunk=5, **kw)
    loss.backward()
    m = mb["mask"]
    assert abs(loss.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    torch.testing.assert_close(lp[m], logp.detach()[m], atol=1e-5, rtol=1e-5)
    assert torch.all(lp[~m] == 0) and torch.all(ent[~m] == 0) and torch.all(ent[m] > 0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_tis_from_the_training_pass_equals_tis_from_a_separate_forward(mode):
    """On-policy with TIS (one optimizer step per cycle): the weight taken from the fused pass's own
    log-probs gives the loss and gradient of the plain path with old = a no-grad forward's log-probs."""
    model, mb = tiny_lm(True), batch()
    m = mb["mask"]
    with torch.no_grad():
        old = completion_logprobs(model, mb, 0.9)[0]
    mb["sampler_logp"] = old + 0.3 * torch.randn(4, 7, generator=torch.Generator().manual_seed(2)).to(DEV)
    per_kw = dict(sampler_logp=mb["sampler_logp"], tis_cap=1.1, tis_mode=mode)
    logp, _ = completion_logprobs(model, mb, 0.9)
    want = aggregate_loss(per_token_loss(logp, old, mb["advantages"], m, **per_kw), m, "dapo")
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    seen = []
    def tis_from(lp):
        seen.append(lp)
        return tis_weight(lp, mb["sampler_logp"], m, 1.1, mode)
    loss, lp, _ = completion_grpo_loss(model, mb, 0.9, token_weights(m, "dapo"), tis_from=tis_from, chunk=5)
    loss.backward()
    torch.testing.assert_close(seen[0][m], old[m], atol=1e-5, rtol=1e-5)  # the weight saw this pass's log-probs
    assert not seen[0].requires_grad
    assert abs(loss.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], atol=1e-6, rtol=1e-4, msg=n)
    # and the weight matters here: without it the gradient differs
    model.zero_grad()
    completion_grpo_loss(model, mb, 0.9, token_weights(m, "dapo"), chunk=5)[0].backward()
    assert any(not torch.allclose(p.grad, want_grads[n], atol=1e-6) for n, p in model.named_parameters())


def test_all_masked_micro_batch_gives_zero_loss_with_a_graph():
    model, mb = tiny_lm(False), batch()
    mb["mask"][:] = False
    loss, lp, _ = completion_grpo_loss(model, mb, 1.0, token_weights(mb["mask"], "dapo"))
    loss.backward()
    assert loss.item() == 0 and torch.all(lp == 0)
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.parameters())
