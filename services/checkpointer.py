"""The one owner of checkpoints: when to save, where, how many to keep, what to resume from.

The learner writes what it is told to (its DeepSpeed state, RNG, and the controller's state passed
along) into `<dir>.tmp` and renames it when complete; the controller and the learner ranks must
therefore see the same `checkpoint_dir` (a filesystem shared by every node: README)."""

from __future__ import annotations

import shutil
from pathlib import Path


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint dirs that finished writing (tandem.json inside, no .tmp suffix), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "tandem.json").is_file())


class Checkpointer:
    def __init__(self, cfg):
        self.root = Path(cfg.checkpoint_dir)
        self.save_steps = cfg.checkpoint.save_steps
        self.keep = cfg.checkpoint.save_total_limit

    def due(self, steps: list[int]) -> bool:
        """A cycle that ran optimizer steps `steps` saves when one of them is a multiple of save_steps
        (the end of a run saves too: the driver's last call, `Controller.save_checkpoint`)."""
        return bool(self.save_steps and any(s % self.save_steps == 0 for s in steps))

    def path(self, cycle: int) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        return str(self.root / f"cycle-{cycle:06d}")

    def prune(self) -> None:
        if self.keep is None:
            return
        for old in complete_checkpoints(self.root)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None
