"""`cluster.vllm_mode: colocate`: the policy's frozen base weights read from the engine beside it in the same process
instead of held twice (Unsloth's fast_inference shares them the same way). vLLM keeps a layer's q, k and v projections
as one packed tensor (qkv_proj), gate and up as another (gate_up_proj), and may pad the vocabulary; each of the
policy's tensors becomes a view of its slice. A tensor is shared only where it equals what the policy loaded from the
checkpoint: a layer vLLM keeps in another form (quantized, or repacked as its CPU backend repacks linear weights) stays
the policy's own. Only while publishing leaves the engine's weights as loaded: a LoRA adapter served beside them (a
merged adapter or full weights are reloaded into them each publish: the caller passes none then)."""

from __future__ import annotations

import torch


def checkpoint_name(name: str) -> str:
    """A policy parameter's name as the checkpoint has it (peft's wrapper and base_layer out)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def frozen_parameters(model) -> dict:
    """The model's parameters that no optimizer step moves, by checkpoint name."""
    return {checkpoint_name(n): p for n, p in model.named_parameters() if not p.requires_grad}


def engine_views(engine: dict, packed: dict, shapes: dict) -> dict:
    """Checkpoint name -> the engine's tensor, or the slice of it that holds that tensor. `engine`: vLLM's parameters
    by name (a LoRA layer's base under `.base_layer.`); `packed`: the engine's packed layers ({"qkv_proj": ["q_proj",
    "k_proj", "v_proj"], ...}); `shapes`: the shapes of the policy's tensors to find, by checkpoint name. A packed
    tensor's members fill it exactly, in order; an unpacked one may have rows past the policy's (a padded vocabulary).
    Names or shapes that do not fit give no view."""
    out = {}
    for vname, t in engine.items():
        name = checkpoint_name(vname)
        module, _, leaf = name.rpartition(".")
        parent, _, layer = module.rpartition(".")
        members = [f"{parent}.{m}.{leaf}" if parent else f"{m}.{leaf}" for m in packed.get(layer, ())] or [name]
        if any(m not in shapes for m in members):
            continue
        rows = [tuple(shapes[m]) for m in members]
        if any(t.dim() != len(s) or t.dim() == 0 or tuple(t.shape[1:]) != s[1:] for s in rows):
            continue
        total = sum(s[0] for s in rows)
        if total > t.shape[0] or (len(members) > 1 and total != t.shape[0]):
            continue
        offset = 0
        for m, s in zip(members, rows):
            out[m] = t.narrow(0, offset, s[0])
            offset += s[0]
    return out


def learner_device() -> torch.device:
    """Where DeepSpeed places this rank's model: the process's current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def share_engine_weights(model, engine: dict, packed: dict, device) -> int:
    """Each frozen tensor of `model` that equals its slice of the engine's weights (on `device`) becomes a view of it;
    the rest stay the model's own, for DeepSpeed to place. -> the bytes now read from the engine."""
    device = torch.device(device)
    frozen = frozen_parameters(model)
    shared = 0
    for name, view in engine_views(engine, packed, {n: p.shape for n, p in frozen.items()}).items():
        p = frozen[name]
        if view.dtype != p.dtype or view.device != device:
            continue
        if torch.equal(p.data.to(device), view):
            p.data = view
            shared += view.numel() * view.element_size()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copies compared: none of them should stay reserved in the process's peak
    return shared
