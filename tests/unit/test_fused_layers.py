"""model.use_liger_kernel: Liger's Triton RMSNorm, SwiGLU and RoPE patched into a model's own layers
(kernels/fused_layers.py). Off a GPU a patched layer runs its own forward (the padding-free probe and any CPU forward stay exact); asked for
where it cannot run, the job is refused by name. The kernels' agreement with transformers' layers runs on the GPU
machine (bench/device: pytest tests/unit/test_fused_layers.py there)."""

import pytest
import torch

from tests.helpers import ROOT, make_job

REWARD = f"{ROOT}/examples/rewards.py:length_reward"


def _qwen2(tiny_model, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype)


def test_every_norm_and_mlp_is_patched_and_a_cpu_forward_is_the_models_own(tiny_model):
    from tandem.kernels.fused_layers import fuse_layers

    model, plain = _qwen2(tiny_model), _qwen2(tiny_model)
    layers = model.config.num_hidden_layers
    # two norms a layer, the final norm, one MLP and one attention (its RoPE) a layer
    assert fuse_layers(model) == 2 * layers + 1 + layers + layers
    ids = torch.randint(0, 512, (2, 9))
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
    # the RoPE dispatcher is module-wide: a model built after it, and a second patch, change nothing on the CPU
    later = _qwen2(tiny_model)
    assert fuse_layers(later) == 2 * layers + 1 + layers + layers
    torch.testing.assert_close(later(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)


def _liger_runs() -> bool:
    from tandem.kernels.fused_layers import liger_missing

    return liger_missing() is None


@pytest.mark.skipif(_liger_runs(), reason="Liger runs here (the GPU machine): the refusal is this CPU's")
def test_asking_for_liger_where_it_cannot_run_names_the_field(tmp_path, tiny_model):
    from tandem.core.config import JobConfigError
    from tandem.learner.model import load_policy, uses_liger

    with pytest.raises(JobConfigError, match=r"model.use_liger_kernel = true: no CUDA device"):
        load_policy(make_job(tmp_path, tiny_model, [REWARD], model={"use_liger_kernel": True}))
    assert not uses_liger(load_policy(make_job(tmp_path, tiny_model, [REWARD])))  # auto: off here, silently


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels are Triton on CUDA (the GPU machine runs this)")
def test_liger_layers_follow_transformers_on_the_gpu(tiny_model):
    import liger_kernel.transformers.rope as liger_rope

    from tandem.kernels.fused_layers import fuse_layers, liger_missing

    assert liger_missing() is None
    model, plain = (_qwen2(tiny_model, torch.bfloat16).cuda() for _ in range(2))
    fuse_layers(model)
    ids = torch.randint(0, 512, (3, 40), device="cuda")
    calls, own = [], liger_rope.liger_rotary_pos_emb
    liger_rope.liger_rotary_pos_emb = lambda *a: calls.append(1) or own(*a)  # counts, computes as Liger does
    try:
        a = model(input_ids=ids).logits.float()
        assert len(calls) == model.config.num_hidden_layers  # Liger's RoPE in every patched attention
        b = plain(input_ids=ids).logits.float()
        assert len(calls) == model.config.num_hidden_layers  # and in no attention that was not patched
    finally:
        liger_rope.liger_rotary_pos_emb = own
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    a.square().mean().backward()
    b.square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=0.1, atol=0.02, msg=n)
