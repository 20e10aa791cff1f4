"""`tandem export RUN_OR_CHECKPOINT --merged DIR`: the trained adapter merged into its base model, as a
transformers model directory (safetensors, config, tokenizer) that serves without peft. The run may be a storage
URI (s3://...): its adapter is copied to a temporary directory here first."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tandem.core.adapter import ADAPTER_DIR, find_adapter
from tandem.core.config import JobConfigError
from tandem.core.hub import model_dir
from tandem.core.storage import Location, Store, first_line, is_uri


def stored_adapter(source: str, local: Path) -> Path:
    """A storage URI's adapter (a run's final one, a checkpoint's, or an adapter directory) copied into `local`;
    looked for as find_adapter looks on a local path. -> the local copy."""
    from tandem.services.orchestrator.checkpointer import complete_checkpoints

    src = Location(source)
    try:
        found = next((c for c in (src, src / ADAPTER_DIR) if Store(c).is_file("adapter_config.json")), None)
        if found is None:
            cks = [c / ADAPTER_DIR for c in complete_checkpoints(src / "checkpoints")]
            found = next((c for c in reversed(cks) if Store(c).is_file("adapter_config.json")), None)
        if found is None:
            raise JobConfigError(f"tandem export: {source!r}: no adapter there (looked for adapter_config.json in "
                                 f"it, in {ADAPTER_DIR}/, and in checkpoints/cycle-*/adapter/)")
        Store(found).download("", local)
    except OSError as e:
        raise JobConfigError(f"tandem export: {source!r}: cannot read it ({first_line(e)}); allowed: a storage URI "
                             "whose credentials and endpoint this machine's environment gives") from None
    return local


def export_merged(source: str, out: str, dtype: str | None = None, base: str | None = None) -> Path:
    """base: the base model here (a directory or a Hub id in this machine's cache), where the one the adapter
    records (adapter_config.json's base_model_name_or_path: the model as the job named it) is not reachable."""
    if is_uri(source):
        with tempfile.TemporaryDirectory(prefix="tandem-adapter-") as tmp:
            return export_merged(str(stored_adapter(source, Path(tmp))), out, dtype, base)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        adapter = find_adapter(source)
    except FileNotFoundError as e:
        raise JobConfigError(f"tandem export: {e}") from None
    conf = json.loads((adapter / "adapter_config.json").read_text())
    named = base or conf["base_model_name_or_path"]
    base_path = model_dir(named, None if base else conf.get("revision"))  # a Hub id: this machine's cache
    if not (Path(base_path) / "config.json").is_file():
        where = f"--base {base!r}" if base else f"the adapter's base model {base_path!r} (adapter_config.json)"
        raise JobConfigError(f"tandem export: {where} is not a model directory on this machine; allowed: --base "
                             "naming the base model here (a directory with its config.json, or a Hub id in this "
                             "machine's cache)")
    kw = {"dtype": getattr(torch, dtype)} if dtype else {"dtype": "auto"}
    base = AutoModelForCausalLM.from_pretrained(base_path, **kw)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    dst = Path(out)
    merged.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(dst)
    return dst
