"""`tandem export RUN_OR_CHECKPOINT --merged DIR`: the trained adapter merged into its base model, as a
transformers model directory (safetensors, config, tokenizer) that serves without peft."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.core.adapter import find_adapter
from tandem.core.config import JobConfigError
from tandem.core.hub import model_dir


def export_merged(source: str, out: str, dtype: str | None = None) -> Path:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        adapter = find_adapter(source)
    except FileNotFoundError as e:
        raise JobConfigError(f"tandem export: {e}") from None
    conf = json.loads((adapter / "adapter_config.json").read_text())
    base_path = model_dir(conf["base_model_name_or_path"], conf.get("revision"))  # a Hub id: this machine's cache
    if not (Path(base_path) / "config.json").is_file():
        raise JobConfigError(f"tandem export: the adapter's base model {base_path!r} (adapter_config.json) is not "
                             "a model directory on this machine")
    kw = {"dtype": getattr(torch, dtype)} if dtype else {"dtype": "auto"}
    base = AutoModelForCausalLM.from_pretrained(base_path, **kw)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    dst = Path(out)
    merged.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(dst)
    return dst
