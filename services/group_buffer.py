"""Scored groups waiting for the learner, oldest first, with the policy version that sampled each.
Staleness is decided here: a group more than `max_staleness` versions behind is handed back to be
sampled again, never trained on."""

from __future__ import annotations


class GroupBuffer:
    def __init__(self, max_staleness: int):
        self.k = max_staleness
        self.groups: list = []  # (meta, group ref); meta has index, epoch, version, tokens

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, meta: dict, ref) -> None:
        self.groups.append((meta, ref))

    def drop_stale(self, version: int) -> list[dict]:
        """Metas of the groups too stale for a learner at `version`, removed."""
        stale = [m for m, _ in self.groups if version - m["version"] > self.k]
        self.groups = [(m, r) for m, r in self.groups if version - m["version"] <= self.k]
        return stale

    def take(self, n: int) -> list:
        batch, self.groups = self.groups[:n], self.groups[n:]
        return batch

    def pending(self) -> list[tuple[int, int]]:
        return [(m["index"], m["epoch"]) for m, _ in self.groups]
