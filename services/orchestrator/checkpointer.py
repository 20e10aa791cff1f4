"""The one owner of checkpoints: when to save, where, how many to keep, what to resume from.

The learner writes what it is told to (its DeepSpeed state, RNG, and the controller's state passed
along): on a local path into `<dir>.tmp`, renamed when complete (the controller and the learner ranks then see
one filesystem); on a storage URI every part first and `tandem.json` last (tandem.core.storage). Either way a
checkpoint without tandem.json is incomplete: never listed, never resumed from."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

from tandem.core.config import JobConfigError
from tandem.core.storage import Location, Store, as_named, first_line, is_uri

# what may change between a run and its resume without changing what was trained or the data order
RESUMABLE_CHANGES = {("batch", "max_steps"), ("batch", "num_train_epochs"), ("checkpoint", None), ("logging", None),
                     ("cluster", "num_rollout_workers"), ("cluster", "address"), ("cluster", "rollout_resources"),
                     ("cluster", "rollout_prompts_in_flight"), ("cluster", "vllm_enforce_eager"),
                     ("cluster", "vllm_merge_adapter"),
                     ("cluster", "vllm_gpu_memory_utilization"), ("cluster", "vllm_max_num_seqs"), ("cluster", "max_restarts"),
                     ("eval", None), ("tool_isolation", None),
                     ("cluster", "autoscale")}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _files_digest(path: Path, names=None) -> str:
    """Content hash of a file, or of a directory's files (those named, when given)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file()
                                                 and (names is None or f.name in names))
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def rows_digest(rows: list) -> str:
    """Content hash of rows read from the Hub or given from Python (a local file's is its bytes')."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(cfg, n_rows: int, content: str | None = None) -> dict:
    """What determines the data order and the training: the job's training settings, the dataset (path,
    rows, content: `content` where the rows came from the Hub or from Python), the seed, the model and tokenizer
    files. Kept in every checkpoint; resume compares."""
    d = cfg.model_dump(mode="json")
    training = {sec: ({k: v for k, v in val.items() if (sec, k) not in RESUMABLE_CHANGES}
                      if isinstance(val, dict) else val)
                for sec, val in d.items() if (sec, None) not in RESUMABLE_CHANGES and sec not in ("data", "seed")}
    model = Path(cfg.model.local_dir())
    local = content is None
    return {"job": _digest(training), "data.path": as_named(cfg.data.path) if local else cfg.data.path,
            "data rows": n_rows, "data content": _files_digest(Path(cfg.data.path)) if local else content,
            "data order": _digest([d["data"], d["seed"]]),
            "model files": _files_digest(model, {"config.json", "model.safetensors", "tokenizer.json",
                                                 "tokenizer_config.json", "special_tokens_map.json"})}


def fingerprint_changes(saved: dict, now: dict) -> list[str]:
    return [f"{k} ({saved.get(k)} -> {now.get(k)})" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


def readable(ckpt: Location) -> str | None:
    """Why a checkpoint that looks complete cannot be resumed from (a cut tandem.json, a missing part, a state file
    cut short: torch.save writes a zip whose index is its last bytes), or None. Reads no tensor."""
    ckpt, store = Location(ckpt), Store(ckpt)
    try:
        meta = json.loads(store.read_text("tandem.json"))
    except (OSError, ValueError) as e:
        return f"{ckpt / 'tandem.json'}: {first_line(e)}"
    if wrong := meta_error(meta):
        return f"{ckpt / 'tandem.json'}: {wrong}"
    for part in ("state", "rng_rank0.safetensors"):
        if not store.exists(part):
            return f"{ckpt / part}: missing"
    for pt in (f for f in store.files("state") if f.endswith(".pt")):
        try:
            with store.open_input(f"state/{pt}") as fh:
                zipfile.ZipFile(fh).close()
        except (OSError, zipfile.BadZipFile) as e:
            return f"{ckpt / 'state' / pt}: cut short or not written by torch.save ({e})"
    return None


CONTROLLER_PARTS = ("source", "progress", "record", "buffer", "failures", "counters")


def meta_error(meta) -> str | None:
    """What in a checkpoint's tandem.json (hand-edited, or written by something else) does not have the type
    resuming reads it as, or None."""
    if not isinstance(meta, dict):
        return f"holds a {type(meta).__name__}; expected an object with version, steps and controller"
    for key in ("version", "steps"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"{key} is {v!r} ({type(v).__name__}); expected a whole number >= 0"
    ctl = meta.get("controller")
    if not isinstance(ctl, dict):
        return f"controller is {ctl!r:.40} ({type(ctl).__name__}); expected an object"
    for part in CONTROLLER_PARTS + ("fingerprint",):
        v = ctl.get(part, {} if part == "fingerprint" else None)
        if not isinstance(v, dict):
            return f"controller.{part} is {v!r:.40} ({type(v).__name__}); expected an object"
    return None


CHECKPOINT_NAME = re.compile(r"cycle-\d{6,}")  # Checkpointer.path's names: not `.tmp`, not `.refused`


def complete_checkpoints(root: str) -> list[Location]:
    """Checkpoint dirs that finished writing (tandem.json inside, no .tmp suffix), oldest first."""
    store, root = Store(root), Location(root)
    return [root / name for name, is_dir in store.children()
            if is_dir and CHECKPOINT_NAME.fullmatch(name) and store.is_file(f"{name}/tandem.json")]


class Checkpointer:
    def __init__(self, cfg):
        self.root = Location(cfg.checkpoint_dir)
        self.save_steps = cfg.checkpoint.save_steps
        self.keep = cfg.checkpoint.save_total_limit
        self.fingerprint: dict | None = None  # the job's (fingerprint()), kept in every checkpoint, compared on resume
        self.skipped: list[str] = []  # the checkpoints the last resume passed over, with why and where they went

    def due(self, steps: list[int]) -> bool:
        """A cycle that ran optimizer steps `steps` saves when one of them is a multiple of save_steps
        (the end of a run saves too: the driver's last call, `Controller.save_checkpoint`)."""
        return bool(self.save_steps and any(s % self.save_steps == 0 for s in steps))

    def path(self, cycle: int) -> str:
        if not is_uri(self.root):
            Path(self.root).mkdir(parents=True, exist_ok=True)
        return str(self.root / f"cycle-{cycle:06d}")

    def prune(self) -> None:
        if self.keep is None:
            return
        for old in complete_checkpoints(self.root)[:-self.keep]:
            Store(old).delete()

    def latest(self) -> Location | None:
        return next((ck for ck, why in self.candidates() if why is None), None)

    def candidates(self) -> list[tuple[Location, str | None]]:
        """Complete checkpoints, newest first, each with why it cannot be resumed from (None: it looks readable)."""
        return [(ck, readable(ck)) for ck in reversed(complete_checkpoints(self.root))]

    @staticmethod
    def set_aside(ck: Location) -> Location:
        """A refused checkpoint newer than the one resumed from, renamed `<name>.refused` (an object store's: copied,
        then deleted): kept for a look, and out of the way of retention and of the save that will reach its cycle
        again. -> its new path."""
        ck = Location(ck)
        parent = Location(str(ck)[:-len(ck.name)].rstrip("/"))
        dst, n = parent / (ck.name + ".refused"), 1
        while Store(dst).exists():
            n += 1
            dst = parent / f"{ck.name}.refused-{n}"
        if is_uri(ck):
            Store(ck).copy_to("", Store(dst))
            Store(ck).delete()
        else:
            Path(ck).rename(dst)
        return dst

    def resume(self, load) -> tuple[Path, dict] | None:
        """The newest checkpoint that `load(path) -> meta` takes, and its meta; None when there is none. Those it
        passes over (unreadable, or `load` failed; a JobConfigError from `load` is no such failure: it stops the
        resume) are named in `skipped` and, being newer than the one taken, set aside. When checkpoints exist and
        none loads, the run is refused, naming each: a fresh start would train over the run."""
        passed, self.skipped = [], []
        for ck, why in self.candidates():
            if why is None:
                try:
                    meta = load(ck)
                except JobConfigError:
                    raise
                except Exception as e:  # noqa: BLE001 - a part DeepSpeed cannot read: an older one may do
                    why = f"failed to load: {(str(e).strip().splitlines() or [type(e).__name__])[-1][:200]}"
                else:
                    self.skipped = [f"checkpoint {c.name} skipped: {w}; kept as {self.set_aside(c).name}"
                                    for c, w in passed]
                    return ck, meta
            passed.append((ck, why))
        if passed:
            raise self._refusal(passed)
        return None

    def refuse_another_job(self, ck: Path, allowed: bool) -> None:
        """Raises when checkpoint `ck` was written by a job whose fingerprint differs from this one's (unless
        `allowed`: checkpoint.allow_changed_job); checkpoints written before fingerprints pass."""
        saved = json.loads(Store(ck).read_text("tandem.json"))["controller"].get("fingerprint")
        changed = fingerprint_changes(saved, self.fingerprint) if saved else []
        if changed and not allowed:
            raise JobConfigError(f"checkpoint.resume: {ck} was written by a different job: {'; '.join(changed)}; "
                                 "allowed: the same data, seed, model and training settings, or "
                                 "checkpoint.allow_changed_job: true")

    def refuse_if_none_readable(self) -> None:
        """Before any actor starts: where checkpoints exist and none looks readable, the refusal `resume` would give
        after starting them all."""
        found = self.candidates()
        if found and all(why for _, why in found):
            raise self._refusal(found)

    def _refusal(self, passed: list[tuple[Location, str]]) -> JobConfigError:
        return JobConfigError(f"checkpoint.resume: no checkpoint in {self.root} can be resumed from: " +
                              "; ".join(f"{ck.name} ({why})" for ck, why in passed) +
                              "; allowed: repair or remove them, or logging.overwrite_output_dir: true to start over")


def clear_run_dir(cfg) -> None:
    """overwrite_output_dir: the earlier run's record, checkpoints and artifact go before this one writes (never
    the model the job trains: examples keep it at <output_dir>/model)."""
    from tandem.services.orchestrator.trl_checkpoint import trl_checkpoints

    out = Location(cfg.logging.output_dir)
    model = Path(cfg.model.path).resolve()
    trl = [ck for _, ck in trl_checkpoints(str(out))]  # TRL's checkpoint-N copies of the same run
    for d in (out / "metrics.jsonl", out / "failed_prompts.jsonl", out / "group_trace.jsonl",
              Location(cfg.checkpoint_dir), out / "adapter", out / "model", *trl):
        if is_uri(d) or not model.is_relative_to(Path(d).resolve()):  # the job's model in its run dir stays
            Store(d).delete()
