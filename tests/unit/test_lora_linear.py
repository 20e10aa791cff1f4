"""The fused LoRA linear against plain autograd, and against peft's own lora.Linear inside a peft model."""

import copy

import pytest
import torch

from tandem.kernels.lora_linear import lora_linear, lora_linear_reference
from tandem.learner.model import fuse_lora_linears


def _inputs(shape, n_in, n_out, r, bias, train_base):
    g = torch.Generator().manual_seed(0)
    t = lambda *s, grad=True: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(grad)
    x = t(*shape, n_in)
    w = t(n_out, n_in, grad=train_base)
    b = t(n_out, grad=train_base) if bias else None
    return x, w, b, t(r, n_in), t(n_out, r)


@pytest.mark.parametrize("shape,bias,train_base", [((3, 5), True, False), ((7,), False, False), ((2, 3), True, True)])
def test_lora_linear_matches_autograd_of_the_plain_ops(shape, bias, train_base):
    x, w, b, a, bb = _inputs(shape, 6, 4, 3, bias, train_base)
    up = torch.randn(*shape, 4, dtype=torch.float64)
    leaves = [v for v in (x, w, b, a, bb) if v is not None and v.requires_grad]
    y = lora_linear(x, w, b, a, bb, 2.5)
    got = torch.autograd.grad((y * up).sum(), leaves)
    ref_y = lora_linear_reference(x, w, b, a, bb, 2.5)
    want = torch.autograd.grad((ref_y * up).sum(), leaves)
    assert y.shape == ref_y.shape
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


def test_lora_linear_skips_gradients_nobody_asked_for():
    x, w, b, a, bb = _inputs((4,), 6, 4, 2, True, False)
    x.requires_grad_(False)
    (ga,) = torch.autograd.grad(lora_linear(x, w, b, a, bb, 1.0).sum(), [a])
    (ra,) = torch.autograd.grad(lora_linear_reference(x, w, b, a, bb, 1.0).sum(), [a])
    torch.testing.assert_close(ga, ra)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.up = torch.nn.Linear(8, 12, bias=False)
        self.down = torch.nn.Linear(12, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.q(x))))


def _peft(dropout=0.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    m = get_peft_model(_Tiny(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q", "up", "down"]))
    with torch.no_grad():  # peft starts lora_B at zero, which would hide a wrong B path
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return m


def _out_and_grads(m, x):
    y = m(x)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(),
                                [dict(m.named_parameters())[n] for n in names])
    return y, dict(zip(names, grads))


def test_a_fused_peft_model_computes_what_peft_computes():
    plain = _peft()
    fused = copy.deepcopy(plain)
    assert fuse_lora_linears(fused) == 3
    x = torch.randn(2, 5, 8)
    y0, g0 = _out_and_grads(plain, x)
    y1, g1 = _out_and_grads(fused, x)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) == 6
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6)
    with plain.disable_adapter(), fused.disable_adapter():  # the reference policy: the base model
        torch.testing.assert_close(fused(x), plain(x))
        assert not torch.allclose(fused(x), y1)


def test_layers_the_fused_op_does_not_cover_keep_peft_forward():
    plain = _peft(dropout=0.5)
    fused = copy.deepcopy(plain)
    fuse_lora_linears(fused)
    x = torch.randn(3, 8)
    torch.manual_seed(1)
    y0 = plain(x)
    torch.manual_seed(1)
    torch.testing.assert_close(fused(x), y0)  # the same dropout masks: peft's own path ran
