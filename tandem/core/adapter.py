"""The trained adapter as an artifact: PEFT's on-disk format (adapter_config.json +
adapter_model.safetensors, the base model's path recorded), which `PeftModel.from_pretrained` and vLLM's
`LoRARequest` load. The learner writes one into every checkpoint and the run directory at the end; the
rollout engines write the published versions the same way for vLLM."""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_DIR = "adapter"  # inside a checkpoint and inside the run directory


def peft_config(lora, base_path: str, revision: str | None = None) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_path), "revision": revision,
        "r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
        "target_modules": list(lora.target_modules), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }


def write_peft_adapter(out: Path, tensors: dict, lora, base_path: str, revision: str | None = None) -> Path:
    """tensors: peft's state dict (get_peft_model_state_dict names). Safetensors: loading runs no code."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_config(lora, base_path, revision), indent=1))
    return out


def find_adapter(path: str | Path) -> Path:
    """The adapter of a run directory (its final one), of a checkpoint, or an adapter directory itself."""
    p = Path(path)
    for cand in (p, p / ADAPTER_DIR):
        if (cand / "adapter_config.json").is_file():
            return cand
    ckpts = sorted(c for c in (p / "checkpoints").glob("cycle-*") if (c / ADAPTER_DIR / "adapter_config.json").is_file()) \
        if (p / "checkpoints").is_dir() else []
    if ckpts:
        return ckpts[-1] / ADAPTER_DIR
    raise FileNotFoundError(f"{str(p)!r}: no adapter here (looked for adapter_config.json in it, in {ADAPTER_DIR}/, "
                            "and in checkpoints/cycle-*/adapter/); give a run directory, a checkpoint or an adapter")


def with_lora(model, lora, model_path: str, *, dropout: float | None = None):
    """`model` wrapped by peft's LoRA as the job's `model.lora` says; a target module the model lacks is a
    JobConfigError naming the field, the bad names and the model's linear layers (peft's own ValueError does
    not cross a Ray actor's boundary as itself)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tandem.core.config import JobConfigError

    lc = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout if dropout is None else dropout,
                    target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lc)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        names = sorted({n.rsplit(".", 1)[-1] for n, x in model.named_modules() if isinstance(x, torch.nn.Linear)})
        raise JobConfigError(f"model.lora.target_modules = {list(lora.target_modules)}: "
                             f"{str(e).strip().splitlines()[0]}; allowed: names of {model_path}'s linear layers, "
                             f"e.g. {names}") from None
