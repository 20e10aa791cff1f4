"""Which prompts of each epoch a job has used (trained on, or filtered by dynamic sampling): one bit per
dataset row for each epoch still open, a count for each closed one. Its size stays O(rows / 8) bytes
however long the run (a list of every trained group grew by ~15 B a group, in memory and in every
checkpoint). Using a prompt twice in one epoch is a bug in the controller: it raises."""

from __future__ import annotations

import base64
from collections import Counter, deque

import numpy as np

RECENT = 4096  # the latest trained / filtered groups kept in memory with their versions (metrics, a reader)
OPEN_EPOCHS = 3  # a re-queued prompt of an older epoch can still arrive while newer epochs run


class EpochRecord:
    def __init__(self, rows: int, what: str = "trained on"):
        self.rows, self.what = rows, what
        self.bits: dict[int, np.ndarray] = {}
        self.counts: Counter = Counter()

    def add(self, epoch: int, index: int) -> None:
        if epoch not in self.bits and self.bits and epoch < min(self.bits):
            self.counts[epoch] += 1  # an epoch closed long ago: counted, not checked
            return
        b = self.bits.setdefault(epoch, np.zeros(self.rows, dtype=bool))
        if b[index]:
            raise RuntimeError(f"prompt {index} of epoch {epoch} was {self.what} twice")
        b[index] = True
        self.counts[epoch] += 1
        while len(self.bits) > OPEN_EPOCHS:
            del self.bits[min(self.bits)]

    def __contains__(self, pair: tuple[int, int]) -> bool:
        epoch, index = pair
        return epoch in self.bits and bool(self.bits[epoch][index])

    def __len__(self) -> int:
        return sum(self.counts.values())

    def pairs(self) -> list[tuple[int, int]]:
        """(epoch, index) of every prompt used in the open epochs."""
        return [(e, int(i)) for e in sorted(self.bits) for i in np.flatnonzero(self.bits[e])]

    def state(self) -> dict:
        return {"rows": self.rows, "counts": {str(e): c for e, c in self.counts.items()},
                "bits": {str(e): base64.b64encode(np.packbits(b).tobytes()).decode() for e, b in self.bits.items()}}

    def load(self, st: dict) -> None:
        if st["rows"] != self.rows:
            raise ValueError(f"EpochRecord.load: a record of {st['rows']} rows for a dataset of {self.rows}")
        self.counts = Counter({int(e): c for e, c in st["counts"].items()})
        self.bits = {int(e): np.unpackbits(np.frombuffer(base64.b64decode(v), dtype=np.uint8),
                                           count=self.rows).astype(bool) for e, v in st["bits"].items()}

    @classmethod
    def from_pairs(cls, rows: int, pairs, what: str = "trained on") -> EpochRecord:
        """From the lists older checkpoints kept ((epoch, index, version) per group)."""
        r = cls(rows, what)
        for e, i, *_ in pairs:
            r.add(int(e), int(i))
        return r


class TrainedRecord:
    """What the learner trained on: the prompts used per epoch (an EpochRecord), and the latest groups with the
    policy version that sampled each (for the metrics and a reader)."""

    TRANSIENT = ("recent",)  # in memory only: after a resume it holds what this process trained

    def __init__(self, rows: int, recent: int = RECENT):
        self.epochs = EpochRecord(rows, "trained on")
        self.recent: deque = deque(maxlen=recent)  # (epoch, index, version)

    def add(self, epoch: int, index: int, version: int) -> None:
        self.epochs.add(epoch, index)
        self.recent.append((epoch, index, version))

    def state(self) -> dict:
        return {"trained": self.epochs.state()}

    def load(self, st: dict) -> None:
        self.epochs.load(st["trained"])
