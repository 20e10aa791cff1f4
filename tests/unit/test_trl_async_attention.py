"""bench/trl_async_attention: the local stand-in for the Hub's FlashAttention-3 kernel that TRL's AsyncGRPOTrainer
loads (the `trl_async` benchmark candidate where the Hub cannot be reached). Its masking against attention written
out one query at a time in float64; TRL's own tree attention through Hugging Face's `kernels` package and
LOCAL_KERNELS; on a GPU (bench/device/cuda_tests.sh), torch's varlen flash attention against the same."""

import importlib.util
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import ROOT

STAND_IN = ROOT / "bench" / "trl_async_attention"


def stand_in():
    spec = importlib.util.spec_from_file_location("fa3_stand_in", STAND_IN / "flash_attn3" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def written_out(q, k, v, cu_q, cu_k, scale, causal, window):
    """One query at a time: the keys it may see (FlashAttention's bottom-right alignment), their softmax, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    left, right = (window[0], 0) if causal else window
    for s in range(len(cu_q) - 1):
        lq, lk = int(cu_q[s + 1] - cu_q[s]), int(cu_k[s + 1] - cu_k[s])
        for h in range(q.shape[1]):
            for i in range(lq):
                pos = i + lk - lq
                keys = [j for j in range(lk) if (right < 0 or j <= pos + right) and (left < 0 or j >= pos - left)]
                if not keys:
                    continue
                qi = q[int(cu_q[s]) + i, h]
                logits = torch.stack([qi @ k[int(cu_k[s]) + j, h // group] * scale for j in keys])
                w = torch.softmax(logits, 0)
                out[int(cu_q[s]) + i, h] = sum(w[n] * v[int(cu_k[s]) + j, h // group] for n, j in enumerate(keys))
    return out


def packed(seed, q_lens, k_lens, heads=4, kv_heads=2, dim=8, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(device, dtype)
    k = torch.randn(sum(k_lens), kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(sum(k_lens), kv_heads, dim, generator=g).to(device, dtype)
    cum = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=device)  # noqa: E731
    return q, k, v, cum(q_lens), cum(k_lens)


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1))])
def test_the_cpu_path_masks_as_flash_attention_does(causal, window):
    # segments with more keys than queries (a tree's branch after its shared prefix), grouped query heads
    q, k, v, cu_q, cu_k = packed(0, [3, 5, 1], [6, 5, 4])
    got = stand_in().flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, softmax_scale=0.3, causal=causal,
                                            window_size=window)
    want = written_out(q, k, v, cu_q, cu_k, 0.3, causal, window)
    assert torch.allclose(got.double(), want, atol=1e-5), (got.double() - want).abs().max()


def test_trls_tree_attention_runs_on_the_stand_in_through_the_kernels_package(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import trl_candidates
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setenv("LOCAL_KERNELS", f"{trl_candidates.FA3_REPO}={trl_candidates.TRL_ASYNC_ATTENTION}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trl_candidates.hf_kernels()
    from trl.experimental.async_grpo import packing

    packing._flash_attn.cache_clear()
    assert trl_candidates.trl_async_blocker() is None
    assert packing._flash_attn().__file__ == str(STAND_IN / "flash_attn3" / "__init__.py")
    # two packed rows, the second a branch whose keys are a shared prefix's (index 0-2) and its own (5-6)
    q, k, v, _, _ = packed(1, [5, 2], [5, 2])
    kv_index = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 5, 6])
    cu_q, cu_k = torch.tensor([0, 5, 7], dtype=torch.int32), torch.tensor([0, 5, 10], dtype=torch.int32)
    module = torch.nn.Module()  # an attention layer as transformers hands it over: its config, a float32 projection
    module.config, module.proj = SimpleNamespace(), torch.nn.Linear(1, 1)
    out, _ = packing.tree_attention(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                    v.transpose(0, 1)[None], None, tree_kv_index=kv_index, tree_cu_seqlens_q=cu_q,
                                    tree_cu_seqlens_k=cu_k, tree_max_seqlen_q=5, tree_max_seqlen_k=5,
                                    scaling=1 / math.sqrt(8))
    want = written_out(q, k[kv_index], v[kv_index], cu_q, cu_k, 1 / math.sqrt(8), True, (-1, -1))
    assert out.shape == (1, 7, 4, 8)
    assert torch.allclose(out[0].double(), want, atol=1e-5)
    packing._flash_attn.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: bench/device/cuda_tests.sh")
@pytest.mark.parametrize("causal", [True, False])
def test_torchs_varlen_flash_attention_matches_on_a_gpu_with_its_gradients(causal):
    fa = stand_in()
    q, k, v, cu_q, cu_k = packed(2, [70, 130, 9], [100, 130, 40], heads=12, kv_heads=2, dim=128,
                                 dtype=torch.bfloat16, device="cuda")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 130, softmax_scale=128 ** -0.5, causal=causal)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    # the reference: the same bf16 inputs in float32, masked attention per segment
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = fa.reference_varlen_attention(q32, k32, v32, cu_q, cu_k, 128 ** -0.5, causal)
    rq, rk, rv = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    # bf16 keeps 8 bits of mantissa (a relative step of 2^-8 = 0.4%) and the kernel rounds P and the output to it:
    # relative errors of a few steps over a tensor's norm, far below what a wrong mask or a head mixed up gives (~1)
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    assert rel(out, ref) < 0.02 and rel(dv, rv) < 0.02
    assert rel(dq, rq) < 0.03 and rel(dk, rk) < 0.03
