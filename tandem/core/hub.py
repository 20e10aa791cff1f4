"""Models and datasets named by their Hugging Face Hub ids (`Qwen/Qwen2.5-1.5B-Instruct`, `openai/gsm8k`).

A job's `model.path`, `data.path` and `eval.path` take a local path or a Hub id; a local path that exists wins.
A Hub id is resolved in the process that loads it, on each node (the learner, every rollout worker, the
controller): through that node's `huggingface_hub` cache (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE honoured),
downloading only where the Hub can be reached, as transformers' `from_pretrained` and datasets' `load_dataset` do.
huggingface_hub and datasets are imported inside the functions: tandem.core stays light."""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path
from typing import Any

from tandem.core.errors import JobConfigError

# huggingface_hub's repo id rule (validate_repo_id): one optional namespace, then a name
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# what a causal LM needs from its repo: config, tokenizer and safetensors weights (`.bin` only where a repo has no
# safetensors, as transformers prefers them)
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".py")


def is_hub_id(value: str | None) -> bool:
    """A name that is no local path and has the shape of a Hub repo id (a local path wins where both could)."""
    if not value or Path(value).exists() or value.startswith((".", "/", "~")) or "--" in value or ".." in value:
        return False
    return bool(_REPO_ID.match(value)) and not value.endswith(_DATA_SUFFIXES)


def hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    """HF_HUB_OFFLINE set, or the Hub's endpoint unreachable from this node (hub_reachable)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or not hub_reachable()


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's endpoint (HF_ENDPOINT) opens, asked once per process. On a machine with
    no route to the Hub, datasets retries each request five times over ~25 s, a line per retry, before it reads its
    cache; an unreachable Hub is therefore read as HF_HUB_OFFLINE, as a user there would set it. Behind an HTTP proxy
    (HTTPS_PROXY) the libraries go through the proxy: taken as reachable."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def offline_where_unreachable():
    """huggingface_hub and datasets in offline mode (their cache only) while the Hub cannot be reached."""
    import datasets
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    was = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = was


def model_dir(path: str, revision: str | None = None) -> str:
    """The local directory of `model.path`: the path itself, the Hub id's snapshot in this node's cache
    (downloaded there first where the Hub can be reached), or a storage URI's copy in this node's cache. A missing
    id is one JobConfigError naming it, the revision and the cache searched."""
    from tandem.core.storage import is_uri

    if is_uri(path):
        return stored_model(path)
    return _snapshot(path, revision) if is_hub_id(path) else path


MODEL_CACHE_ENV = "TANDEM_MODEL_CACHE"


@functools.lru_cache(maxsize=8)
def stored_model(uri: str) -> str:
    """A model at a storage URI (s3://bucket/models/name), copied once per node into its cache (TANDEM_MODEL_CACHE,
    default ~/.cache/tandem/models): a lock keeps a node's processes from copying it twice, and a manifest of the
    files' sizes, written last, says the copy is whole and still the URI's (a changed model is copied again)."""
    import fcntl
    import hashlib
    import json
    import os
    import shutil

    from tandem.core.storage import Store, basename, first_line

    root = Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "tandem" / "models")
    local = root / f"{basename(uri)}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"
    manifest = local / ".tandem-manifest.json"
    try:
        store = Store(uri)
        files = store.sizes()
    except OSError as e:
        raise JobConfigError(f"model.path = {uri!r}: this node cannot read it ({first_line(e)}); allowed: a storage "
                             "URI whose credentials and endpoint this node's environment gives") from None
    if "config.json" not in files:
        raise JobConfigError(f"model.path = {uri!r}: no config.json there; allowed: a transformers model directory "
                             "copied to the storage URI, a local directory or a Hub model id")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{local.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (manifest.is_file() and json.loads(manifest.read_text()) == files):
            shutil.rmtree(local, ignore_errors=True)
            try:
                store.download("", local)
            except OSError as e:
                shutil.rmtree(local, ignore_errors=True)
                raise JobConfigError(f"model.path = {uri!r}: copying it to {local} failed ({first_line(e)})") from None
            manifest.write_text(json.dumps(files))
    return str(local)


@functools.lru_cache(maxsize=8)  # a process resolves its job's model once (every load site asks)
def _snapshot(path: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    try:
        offline = _offline()
        local = snapshot_download(path, revision=revision, allow_patterns=MODEL_FILES, local_files_only=offline)
        if not any(Path(local).glob("*.safetensors")):
            local = snapshot_download(path, revision=revision, allow_patterns=MODEL_FILES + ["*.bin"],
                                      local_files_only=offline)
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, ...
        raise JobConfigError(_missing("model.path", path, revision, "models", e)) from None
    if not (Path(local) / "config.json").is_file():
        raise JobConfigError(f"model.path = {path!r}: the Hub snapshot {local} has no config.json (not a "
                             "transformers model); allowed: a causal LM's repo id or local directory")
    return local


def _missing(field: str, name: str, revision: str | None, kind: str, e: Exception) -> str:
    where = f"revision {revision!r} of " if revision else ""
    from huggingface_hub import constants

    how = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else
           f"the Hub ({constants.ENDPOINT}) cannot be reached from this node" if not hub_reachable() else
           f"the Hub did not give it ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e})")
    return (f"{field} = {name!r}: no local path of that name, and {where}the Hub {kind[:-1]} {name!r} is not in the "
            f"Hugging Face cache {hub_cache() if kind == 'models' else _datasets_cache()} ({how}); allowed: a local "
            f"path, or a Hub id cached on every node (hf download {'--repo-type dataset ' if kind == 'datasets' else ''}{name})")


def _datasets_cache() -> str:
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


def load_hub_dataset(field: str, path: str, name: str | None, split: str, revision: str | None = None
                     ) -> list[dict[str, Any]]:
    """A Hub dataset's split as rows, read with `datasets.load_dataset` (its cache, offline or not)."""
    import datasets

    logging_level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # "using the latest cached version" on every offline read
    try:
        with offline_where_unreachable():
            ds = datasets.load_dataset(path, name, split=split, revision=revision)
    except ValueError as e:
        if "split" in str(e).lower() or "config" in str(e).lower():
            raise JobConfigError(f"{field} = {path!r} (name {name!r}, split {split!r}): {str(e).splitlines()[0]}"
                                 ) from None
        raise JobConfigError(_missing(field, path, revision, "datasets", e)) from None
    except Exception as e:  # ConnectionError offline, DatasetNotFoundError, FileNotFoundError
        raise JobConfigError(_missing(field, path, revision, "datasets", e)) from None
    finally:
        datasets.logging.set_verbosity(logging_level)
    return ds.to_list()
