"""The chunked log-prob path (the learner's on CPU) against float64 full logits."""

import pytest
import torch

from tandem.kernels.logprobs import linear_logprobs, selective_logprobs


@pytest.mark.parametrize("N,H,V,chunk,temp", [(37, 16, 101, 8, 0.7), (5, 8, 33, 64, 1.3), (16, 4, 17, 16, 1.0)])
def test_linear_logprobs_matches_float64(N, H, V, chunk, temp):
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (N,))
    upstream = torch.randn(N, dtype=torch.float64)
    logp, ent = linear_logprobs(h.float(), w.float(), ids, temp, chunk, with_entropy=True)
    (logp.double() * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    z = (h @ w.t()) / temp
    ref = torch.log_softmax(z, -1).gather(-1, ids[:, None]).squeeze(-1)
    (ref * upstream).sum().backward()
    p = torch.softmax(z, -1)
    ref_ent = -(p * torch.log_softmax(z, -1)).sum(-1)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-4)


def test_selective_logprobs_bf16_accumulates_in_float32():
    logits = torch.randn(9, 300) * 4
    ids = torch.randint(0, 300, (9,))
    lp, _ = selective_logprobs(logits.bfloat16(), ids, 0.9)
    ref = torch.log_softmax(logits.bfloat16().double() / 0.9, -1).gather(-1, ids[:, None]).squeeze(-1)
    assert lp.dtype == torch.float32
    assert (lp.double() - ref).abs().max() < 1e-5
