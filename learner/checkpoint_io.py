"""A learner's checkpoint on disk: DeepSpeed's state (model, optimizer, scheduler), every RNG of each rank, the
user's artifact (the adapter in PEFT's format, or a transformers model), and tandem.json (version, steps, the
controller's state). Written to `<dir>.tmp` and renamed when complete; on a storage URI (tandem.core.storage)
written on each rank's node, copied there part by part and tandem.json last. Read without unpickling."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from tandem.core.adapter import ADAPTER_DIR, write_peft_adapter
from tandem.core.hub import is_hub_id
from tandem.core.storage import Store, as_named, first_line, is_uri, staging_dir
from tandem.learner.model import base_model
from tandem.learner.safe_load import CheckpointRefused, CheckpointWriteError


def save_checkpoint(learner, directory: str, extra: dict | None = None) -> str:
    """Written to `<dir>.tmp` and renamed: a crash never leaves a half checkpoint to resume from."""
    if is_uri(directory):
        return save_to_storage(learner, directory, extra)
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if learner.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    learner.barrier()
    try:
        learner.engine.save_checkpoint(str(tmp), tag="state", save_latest=False)
        save_artifact(learner, tmp)
        save_rng(tmp / f"rng_rank{learner.rank}.safetensors")
        learner.barrier()
        if learner.rank == 0:
            (tmp / "tandem.json").write_text(checkpoint_meta(learner, extra))
    except (OSError, RuntimeError) as e:  # a full disk surfaces as torch's "unexpected pos ..." too
        shutil.rmtree(tmp, ignore_errors=True)
        usage = shutil.disk_usage(final.parent) if final.parent.exists() else None
        free = f"{usage.free / 2**20:.0f} MiB free there" if usage else "its directory is gone"
        raise CheckpointWriteError(f"checkpoint: writing {tmp} failed ({type(e).__name__}: {str(e)[:200]}; "
                                   f"{free}): nothing was half-written, the previous checkpoints are kept; "
                                   "allowed: a run directory with room for a checkpoint") from e
    if learner.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    learner.barrier()
    return str(final)


def save_to_storage(learner, uri: str, extra: dict | None) -> str:
    """Each rank writes its parts on its own node and copies them to the URI; rank 0 copies tandem.json last, once
    every rank's parts are there. A copy cut short leaves no tandem.json: the checkpoint is not listed, and the
    next save of that cycle starts by deleting it."""
    local = staging_dir(uri) / f"rank{learner.rank}"
    store = Store(uri)
    shutil.rmtree(local, ignore_errors=True)
    try:
        if learner.rank == 0:
            store.delete()  # an earlier copy of this cycle cut short
        learner.barrier()
        learner.engine.save_checkpoint(str(local), tag="state", save_latest=False)
        save_artifact(learner, local)
        save_rng(local / f"rng_rank{learner.rank}.safetensors")
        store.upload(local)
        learner.barrier()
        if learner.rank == 0:
            store.write_bytes("tandem.json", checkpoint_meta(learner, extra).encode())
    except (OSError, RuntimeError) as e:
        raise CheckpointWriteError(f"checkpoint: writing {uri} failed ({type(e).__name__}: {first_line(e)}): it has "
                                   "no tandem.json, so it is never resumed from; the previous checkpoints are kept; "
                                   "allowed: a storage URI this node can write") from e
    finally:
        shutil.rmtree(local, ignore_errors=True)
    learner.barrier()
    return uri


def checkpoint_meta(learner, extra: dict | None) -> str:
    """tandem.json: the learner's version and steps, and what the caller keeps with them (the controller's state)."""
    return json.dumps({"version": learner.version, "steps": learner.steps, **(extra or {})})


def save_artifact(learner, directory: Path) -> None:
    """What a user loads: the adapter in PEFT's format (LoRA), or a transformers model directory (full
    fine-tuning). Gathered on every rank (ZeRO-3), written by rank 0."""
    sd = learner.gathered_state()
    if learner.rank != 0:
        return
    cfg = learner.cfg
    if cfg.model.lora is not None:
        m = cfg.model  # a Hub id stays the base's name (as peft writes it), a local path is made absolute
        base = m.path if is_hub_id(m.path) or is_uri(m.path) else as_named(m.path)
        write_peft_adapter(directory / ADAPTER_DIR, sd, m.lora, base, m.revision)
        return
    from transformers import AutoTokenizer

    model = learner.model
    base = base_model(model)
    base.save_pretrained(directory / "model", state_dict=sd, safe_serialization=True)
    AutoTokenizer.from_pretrained(cfg.model.local_dir()).save_pretrained(directory / "model")


def load_checkpoint(learner, directory: str) -> dict:
    """Into the learner's engine and this process's RNGs. -> tandem.json's content. A storage URI's is copied to this
    rank's node first (and deleted there once loaded)."""
    if is_uri(directory):
        local = staging_dir(directory) / f"load-rank{learner.rank}"
        shutil.rmtree(local, ignore_errors=True)
        try:
            Store(directory).download("", local)
            return load_checkpoint(learner, str(local))
        finally:
            shutil.rmtree(local, ignore_errors=True)
    d = Path(directory)
    try:
        meta = json.loads((d / "tandem.json").read_text())
    except ValueError as e:
        raise CheckpointRefused(f"checkpoint file {d / 'tandem.json'}: not JSON ({e})") from None
    learner.engine.load_checkpoint(str(d), tag="state", load_optimizer_states=True, load_lr_scheduler_states=True)
    load_rng(d / f"rng_rank{learner.rank}.safetensors")
    learner.version, learner.steps = meta["version"], meta["steps"]
    return meta


def save_rng(path: Path) -> None:
    """Every RNG of this process in a safe format (safetensors + JSON metadata): loading runs no code."""
    from safetensors.torch import save_file

    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        tensors.update({f"cuda_{i}": t for i, t in enumerate(torch.cuda.get_rng_state_all())})
    meta = {"numpy": json.dumps([np_state[0], *[float(x) if isinstance(x, float) else int(x) for x in np_state[2:]]]),
            "python": json.dumps(random.getstate())}
    save_file(tensors, str(path), metadata=meta)


def load_rng(path: Path) -> None:
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a checkpoint written before RNG states were safetensors, or "
                                "an incomplete one)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors' errors do not name the file
        raise CheckpointRefused(f"checkpoint file {path}: not a safetensors file ({e})") from None
    torch.set_rng_state(t["torch"])
    name, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, t["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, state, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(state), gauss))
    cuda = [t[k] for k in sorted((k for k in t if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
