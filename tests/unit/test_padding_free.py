"""model.padding_free on plain tensors and a real tiny model: the packed micro-batch holds the same tokens, each
completion token is predicted from its own sequence's position, and the log-probs equal the padded batch's."""

import pytest
import torch

from tandem.learner.batch import Samples, collate
from tests.helpers.learner import make_groups


def batches(n=2, G=4, seed=3):
    s = Samples.from_groups(make_groups(n, G, seed=seed, vocab=500))
    adv = torch.linspace(-1, 1, len(s))
    rows = range(len(s))
    return s, (collate(s, rows, adv, pad_id=0, mask_truncated=True, padding_free=p) for p in (False, True))


def test_a_packed_micro_batch_holds_every_sequence_once_and_points_at_each_completion_token():
    s, (padded, packed) = batches()
    seqs = [torch.as_tensor(list(s.prompts[i]) + list(s.completions[i])) for i in range(len(s))]
    assert packed["input_ids"].shape == (1, sum(map(len, seqs))) and torch.equal(packed["input_ids"][0], torch.cat(seqs))
    assert torch.equal(packed["position_ids"][0], torch.cat([torch.arange(len(x)) for x in seqs]))
    for k in ("completion_ids", "mask", "sampler_logp", "advantages"):
        assert torch.equal(packed[k], padded[k]), k
    ids, g = packed["input_ids"][0], packed["gather"]
    for b in range(len(s)):
        c = len(s.completions[b])
        assert torch.equal(ids[g[b, :c] + 1], padded["completion_ids"][b, :c])  # position t predicts token t + 1
    assert "attention_mask" not in packed


def test_packed_log_probs_equal_the_padded_ones_and_need_the_restarting_positions(tiny_model):
    from transformers import AutoModelForCausalLM

    from tandem.learner.logprobs import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    s, (padded, packed) = batches()
    with torch.no_grad():
        want, got = (completion_logprobs(model, mb, 1.0)[0] for mb in (padded, packed))
        lengths = torch.tensor([len(c) for c in s.completions])
        m = torch.arange(padded["completion_ids"].shape[1])[None] < lengths[:, None]  # every real completion token
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
        # one sequence after another, positions running on: attention crosses sequences and the numbers move
        run_on = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1])[None]}
        assert not torch.allclose(completion_logprobs(model, run_on, 1.0)[0][m], want[m], atol=1e-3)


def test_the_varlen_attention_keeps_each_packed_sequence_to_itself(tiny_model):
    """model.padding_free loads the model with learner/attention.py's attention: per sequence by cu_seq_lens, no mask
    over the row. Packed log-probs equal the padded ones (transformers' own SDPA); with the offsets of one sequence
    (the packed row seen as one) they move, so the offsets are what keeps sequences apart."""
    from transformers import AutoModelForCausalLM

    from tandem.learner.attention import cu_seq_lens, register
    from tandem.learner.logprobs import completion_logprobs

    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    varlen = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=register()).eval()
    assert varlen.config._attn_implementation == "tandem_varlen"
    s, (padded, packed) = batches()
    lengths = torch.tensor([len(c) for c in s.completions])
    m = torch.arange(padded["completion_ids"].shape[1])[None] < lengths[:, None]
    with torch.no_grad():
        want = completion_logprobs(sdpa, padded, 1.0)[0]
        torch.testing.assert_close(completion_logprobs(varlen, packed, 1.0)[0][m], want[m], rtol=1e-5, atol=1e-5)
        L = packed["input_ids"].shape[1]
        one = {**packed, "cu_seq_lens": cu_seq_lens([L]), "max_length": L}
        assert not torch.allclose(completion_logprobs(varlen, one, 1.0)[0][m], want[m], atol=1e-3)


def attention_float64(q, k, v, lengths, scale):
    """Causal attention of each packed sequence on its own, written out in float64: softmax(q·kᵀ·scale) · v, a query
    seeing the keys at or before it in its sequence, each key/value head serving heads // kv_heads query heads."""
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # [heads, n, d]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def rel_error(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# bfloat16 keeps 8 significant bits: each rounding (the inputs, the kernel's output, its gradients) is off by up to
# 2^-9 ≈ 0.2% of the value, and a gradient passes through a handful of them; 2% of the tensor's norm holds that
# with room, while a wrong sequence boundary or a head served by the wrong key head is off by tens of percent.
BF16_REL = 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn is CUDA's (the GPU machine runs this)")
def test_the_flash_varlen_kernel_matches_per_sequence_attention_in_float64_with_grouped_heads():
    from tandem.learner.attention import _flash_varlen, _per_sequence_sdpa, cu_seq_lens

    torch.manual_seed(0)
    lengths = [5, 300, 1, 77]
    cu = cu_seq_lens(lengths)
    q = torch.randn(383, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(383, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    scale = 128 ** -0.5
    ref = attention_float64(q, k, v, lengths, scale)  # from the same bf16 inputs
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for kernel in (_flash_varlen(q, k, v, cu, 300, scale), _per_sequence_sdpa(q, k, v, cu, scale)):
        assert rel_error(kernel, ref) < BF16_REL
        for got, want in zip(torch.autograd.grad(kernel.float().square().sum(), (q, k, v)), ref_grads):
            assert rel_error(got, want) < BF16_REL
    wrong = attention_float64(q, k, v, [6, 299, 1, 77], scale)  # one token in the wrong sequence: the check sees it
    assert rel_error(wrong, ref) > 10 * BF16_REL


def test_the_per_sequence_attention_keeps_a_sliding_window():
    """Mistral/Qwen2 sliding windows: query i sees keys i - window < j <= i of its own sequence (the eager
    reference below, written out), and the window changes the answer (the test can fail)."""
    from tandem.learner.attention import _per_sequence_sdpa, cu_seq_lens

    torch.manual_seed(0)
    lens, W = [7, 3], 3
    q, k, v = (torch.randn(sum(lens), 4, 8, dtype=torch.float64) for _ in range(3))
    want, start = [], 0
    for n in lens:
        s = torch.einsum("ihd,jhd->hij", q[start:start + n], k[start:start + n]) * 8 ** -0.5
        d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        s = s.masked_fill(~((d >= 0) & (d < W)), float("-inf"))
        want.append(torch.einsum("hij,jhd->ihd", s.softmax(-1), v[start:start + n]))
        start += n
    got = _per_sequence_sdpa(q, k, v, cu_seq_lens(lens), 8 ** -0.5, sliding_window=W)
    torch.testing.assert_close(got, torch.cat(want))
    assert not torch.allclose(_per_sequence_sdpa(q, k, v, cu_seq_lens(lens), 8 ** -0.5), got)


def test_the_probe_tells_a_model_that_keeps_packed_sequences_apart_from_one_that_does_not(tiny_model):
    """learner/model.py pads where the probe fails: a model whose attention runs over the whole packed row (as one
    that drops the cu_seq_lens keywords would) is caught; the packed attention passes."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    from tandem.learner.attention import keeps_sequences_apart, register

    def whole_row(module, q, k, v, mask, **kw):  # causal over the row: what dropped keywords would give
        return sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=kw.get("scaling"))

    AttentionInterface.register("whole_row", whole_row)
    AttentionMaskInterface.register("whole_row", lambda *a, **k: None)
    ok = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=register())
    bad = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="whole_row")
    assert keeps_sequences_apart(ok) and not keeps_sequences_apart(bad)


def test_masked_log_probs_and_the_fused_loss_read_the_decoder_at_the_masked_tokens_only(tiny_model):
    """completion_logprobs(masked=True) and completion_grpo_loss take the hidden states of the masked tokens straight
    from the decoder's output (learner/logprobs.py: _hidden_at): the log-probs at the mask are the full [B, T] pass's,
    0 elsewhere, and the loss and gradients of a packed batch are the padded one's."""
    from transformers import AutoModelForCausalLM

    from tandem.learner.grpo import token_weights
    from tandem.learner.logprobs import completion_grpo_loss, completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    s, (padded, packed) = batches()
    m = padded["mask"]
    assert m.any() and not m.all()  # short completions and a masked truncated one: padding to skip
    with torch.no_grad():
        want, want_ent = completion_logprobs(model, padded, 0.7, with_entropy=True)
        for mb in (padded, packed):
            got, ent = completion_logprobs(model, mb, 0.7, with_entropy=True, masked=True)
            torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent[m], want_ent[m], rtol=1e-5, atol=1e-5)
            assert torch.all(got[~m] == 0) and torch.all(ent[~m] == 0)
    w = token_weights(m, "dapo")
    old = want + 0.1 * torch.randn(want.shape, generator=torch.Generator().manual_seed(4))
    runs = []
    for mb in (padded, packed):
        model.zero_grad()
        loss, lp, _ = completion_grpo_loss(model, mb, 0.7, w, old_logp=old, chunk=5)
        loss.backward()
        runs.append((loss.detach(), lp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, lp0, g0), (l1, lp1, g1) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp1[m], want[m], rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 2
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_an_all_masked_batch_gives_zero_log_probs_that_a_training_pass_can_still_run_backward_on(tiny_model):
    """The two-pass path (sequence-level ratios, the off-policy mask) trains on completion_logprobs(masked=True): a
    micro-batch whose every token is masked (all truncated under mask_truncated_completions) must still give DeepSpeed
    a graph to run backward on."""
    from transformers import AutoModelForCausalLM

    from tandem.learner.logprobs import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for mb in batches()[1]:
        mb["mask"][:] = False
        logp, ent = completion_logprobs(model, mb, 1.0, with_entropy=True, masked=True)
        assert logp.shape == mb["mask"].shape and torch.all(logp == 0) and torch.all(ent == 0)
        model.zero_grad()
        logp.sum().backward()
        assert all(p.grad is None or torch.all(p.grad == 0) for p in model.parameters())


def test_to_device_finds_the_masked_positions_on_the_host_and_the_forward_takes_them():
    """learner/batch.py's to_device adds the flat positions of the mask's tokens, found on the host, and the loss and
    log-prob paths take them from there (a batch without them: found from its mask)."""
    from tandem.learner.batch import to_device
    from tandem.learner.logprobs import masked_positions

    for mb in batches()[1]:
        moved = to_device(mb, "cpu")
        want = torch.tensor([i for i, m in enumerate(mb["mask"].flatten().tolist()) if m], dtype=torch.long)
        assert 0 < want.numel() < mb["mask"].numel()
        assert torch.equal(moved["masked_at"], want)
        assert masked_positions(moved) is moved["masked_at"]
        assert "masked_at" not in mb and torch.equal(masked_positions(mb), want)
