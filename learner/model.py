"""The policy: a transformers causal LM in the job's dtype, LoRA through peft (or full
fine-tuning), and the reference policy only when beta > 0."""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from tandem.core.adapter import with_lora
from tandem.kernels.lora_linear import lora_linear


def load_policy(cfg):
    m = cfg.model
    model = _causal_lm(cfg)
    if m.lora is not None:
        model = with_lora(model, m.lora, m.path)
        if cfg.cluster.zero_stage != 3:  # ZeRO-3 gathers lora_A/lora_B in their own forward hooks
            fuse_lora_linears(model)
    if m.gradient_checkpointing is True:  # "auto": the learner decides once the model is placed (learner/memory.py)
        enable_checkpointing(model)
    return model


def base_model(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_checkpointing(model) -> None:
    """Each decoder layer's activations recomputed in backward (non-reentrant), on a plain or peft model."""
    base = base_model(model)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False
    if base is not model:
        model.enable_input_require_grads()


def checkpointing(model) -> bool:
    base = base_model(model)
    return bool(getattr(base, "is_gradient_checkpointing", False))


def _causal_lm(cfg):
    """The job's model in its dtype, with Liger's layers where model.use_liger_kernel asks (kernels/fused_layers.py)."""
    model = _attending(cfg)
    want = cfg.model.use_liger_kernel
    if want is False:
        return model
    from tandem.kernels.fused_layers import fuse_layers, liger_missing

    why = liger_missing()
    if why is None and fuse_layers(model) == 0:
        why = f"{type(model).__name__} has no Llama-style RMSNorm or SwiGLU MLP"
    if why is not None and want is True:
        from tandem.core.config import JobConfigError

        raise JobConfigError(f"model.use_liger_kernel = true: {why}; allowed: true where liger-kernel and a CUDA "
                             "device are there, auto (on where they are) or false")
    return model


def uses_liger(model) -> bool:
    """Liger's layers are in the model (kernels/fused_layers.py)."""
    return any(hasattr(m, "_own_forward") for m in model.modules())


def _attending(cfg):
    """The job's model in its dtype; with model.padding_free, attending through learner/attention.py when the
    architecture takes it and keeps packed sequences apart with it (a probe), else padded, with a warning."""
    from transformers import AutoModelForCausalLM

    from tandem.learner.attention import keeps_sequences_apart, register

    m = cfg.model
    load = lambda **kw: AutoModelForCausalLM.from_pretrained(m.local_dir(), dtype=getattr(torch, m.dtype), **kw)
    if not m.padding_free:
        return load()
    try:
        model = load(attn_implementation=register())
    except ValueError as e:  # transformers: this architecture does not take a registered attention function
        warnings.warn(f"model.padding_free: {m.path} cannot attend through a packed row ({str(e).splitlines()[0]}); "
                      "the learner pads its micro-batches", stacklevel=2)
        return load()
    if not keeps_sequences_apart(model):
        warnings.warn(f"model.padding_free: {m.path}'s forward lets packed sequences attend to each other (it does "
                      "not pass cu_seq_lens to its attention); the learner pads its micro-batches", stacklevel=2)
        model.set_attn_implementation("sdpa")
    return model


def packs_sequences(model) -> bool:
    """The learner packs micro-batches for this model (model.padding_free, and the model took the attention)."""
    from tandem.learner.attention import NAME

    return getattr(model.config, "_attn_implementation", None) == NAME


def fuse_lora_linears(model) -> int:
    """Every peft `lora.Linear` of `model` computes through `kernels.lora_linear` (the scale and the adds in
    the GEMMs' epilogues) where it is plain LoRA: one active adapter, dropout 0, no DoRA or other variant,
    a dense base weight of the input's dtype. Anything else (the adapter disabled for the reference policy,
    merged, dropout, mixed batches) takes peft's own forward. Returns how many layers were fused."""
    import types

    from peft.tuners.lora.layer import Linear

    n = 0
    for mod in model.modules():
        if type(mod) is Linear and not mod.fan_in_fan_out:
            mod._peft_forward = mod.forward
            mod.forward = types.MethodType(_fused_lora_forward, mod)
            n += 1
    return n


def _fused_lora_forward(self, x, *args, **kwargs):
    names = [a for a in self.active_adapters if a in self.lora_A]
    if args or kwargs or self.disable_adapters or self.merged or len(names) != 1 or names[0] in self.lora_variant \
            or not isinstance(self.lora_dropout[names[0]], torch.nn.Identity):
        return self._peft_forward(x, *args, **kwargs)
    base, a, b = self.base_layer, self.lora_A[names[0]].weight, self.lora_B[names[0]].weight
    if type(base) is not torch.nn.Linear or not (x.dtype == base.weight.dtype == a.dtype == b.dtype):
        return self._peft_forward(x, *args, **kwargs)
    return lora_linear(x, base.weight, base.bias, a, b, self.scaling[names[0]])


def load_frozen_reference(cfg):
    """Full fine-tuning with beta > 0: a frozen copy. (With LoRA the reference is the same model
    with the adapter disabled: see reference_context.)"""

    ref = _causal_lm(cfg)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def reference_context(model):
    """Context in which `model` computes the reference policy: peft's disable_adapter()."""
    if hasattr(model, "disable_adapter"):
        return model.disable_adapter()
    return contextlib.nullcontext()


def decoder_and_head(model):
    """(decoder returning hidden states, lm_head module) of a (peft-wrapped) causal LM."""
    base = base_model(model)
    return base.model, base.lm_head


def copy_to_cpu(tensors: dict) -> dict[str, torch.Tensor]:
    """Host copies of a state dict, one device-to-host transfer per dtype rather than one synchronising
    copy per tensor (336 of them for a LoRA on every linear layer of a 0.5B model)."""
    out, by_dtype = {}, {}
    for k, v in tensors.items():
        if v.device.type == "cpu":
            out[k] = v.detach().clone()
        else:
            by_dtype.setdefault(v.dtype, []).append(k)
    for keys in by_dtype.values():
        flat = torch.cat([tensors[k].detach().reshape(-1) for k in keys]).cpu()
        for k, part in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            out[k] = part.view(tensors[k].shape)
    return {k: out[k] for k in tensors}


# Whether a peft model's adapter carries its embedding layers, per model: peft's default decides it on every call by
# reading the base's config again (from its directory, or asking the Hub), to see whether the vocabulary was resized;
# nothing resizes it during a run, so the first export's answer stands for the rest (a publish each cycle).
_SAVES_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def trainable_state_dict(model) -> dict[str, torch.Tensor]:
    """What the rollout engines load: peft adapter tensors (exactly peft's `get_peft_model_state_dict`), or all
    weights under HF names."""
    if not hasattr(model, "peft_config"):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    if model in _SAVES_EMBEDDINGS:
        return get_peft_model_state_dict(model, save_embedding_layers=_SAVES_EMBEDDINGS[model])
    sd = get_peft_model_state_dict(model)
    _SAVES_EMBEDDINGS[model] = len(sd) > len(get_peft_model_state_dict(model, save_embedding_layers=False))
    return sd
