"""learner/shared_weights.py's name and slice arithmetic on plain tensors: which slice of vLLM's packed, padded tensors
holds each of the policy's (the real engine and policy: tests/integration/test_shared_weights.py)."""

import torch

from tandem.learner.shared_weights import checkpoint_name, engine_views

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_each_checkpoint_tensor_is_its_slice_of_the_engines_packed_or_padded_tensor():
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    embed = torch.randn(10, 4)
    engine = {"model.layers.0.self_attn.qkv_proj.base_layer.weight": torch.cat([q, k, v]),  # a LoRA layer's base
              "model.layers.0.mlp.gate_up_proj.weight": torch.cat([gate, up]),
              "model.embed_tokens.weight": torch.cat([embed, torch.zeros(6, 4)]),  # vocabulary padded to 16
              "model.norm.weight": torch.ones(4)}
    shapes = {"model.layers.0.self_attn.q_proj.weight": (8, 4), "model.layers.0.self_attn.k_proj.weight": (2, 4),
              "model.layers.0.self_attn.v_proj.weight": (2, 4), "model.layers.0.mlp.gate_proj.weight": (6, 4),
              "model.layers.0.mlp.up_proj.weight": (6, 4), "model.embed_tokens.weight": (10, 4),
              "model.norm.weight": (4,)}
    views = engine_views(engine, PACKED, shapes)
    assert set(views) == set(shapes)
    want = {"q_proj": q, "k_proj": k, "v_proj": v, "gate_proj": gate, "up_proj": up}
    for name, t in want.items():
        got = next(x for n, x in views.items() if f".{name}." in n)
        assert torch.equal(got, t)
    assert torch.equal(views["model.embed_tokens.weight"], embed)
    # views, not copies: each shares its engine tensor's storage
    qkv = engine["model.layers.0.self_attn.qkv_proj.base_layer.weight"]
    assert views["model.layers.0.self_attn.k_proj.weight"].data_ptr() == qkv.data_ptr() + 8 * 4 * qkv.element_size()
    assert views["model.embed_tokens.weight"].data_ptr() == engine["model.embed_tokens.weight"].data_ptr()


def test_tensors_that_do_not_fit_give_no_view():
    engine = {"model.layers.0.self_attn.qkv_proj.weight": torch.randn(13, 4),  # one row more than q + k + v
              "model.layers.0.mlp.gate_up_proj.weight": torch.empty(0),  # repacked elsewhere (vLLM's CPU backend)
              "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 8),  # transposed
              "model.embed_tokens.weight": torch.randn(8, 4),  # fewer rows than the policy's vocabulary
              "model.layers.9.mlp.down_proj.weight": torch.randn(4, 6)}  # the policy has no such tensor
    shapes = {"model.layers.0.self_attn.q_proj.weight": (8, 4), "model.layers.0.self_attn.k_proj.weight": (2, 4),
              "model.layers.0.self_attn.v_proj.weight": (2, 4), "model.layers.0.mlp.gate_proj.weight": (6, 4),
              "model.layers.0.mlp.up_proj.weight": (6, 4), "model.layers.0.self_attn.o_proj.weight": (8, 4),
              "model.embed_tokens.weight": (10, 4)}
    assert engine_views(engine, PACKED, shapes) == {}
    # a packed layer whose members the policy lacks in part: none of them
    assert engine_views({"a.qkv_proj.bias": torch.randn(12)}, PACKED, {"a.q_proj.bias": (8,)}) == {}


def test_a_peft_parameter_is_named_as_the_checkpoint_names_it():
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("model.norm.weight") == "model.norm.weight"
