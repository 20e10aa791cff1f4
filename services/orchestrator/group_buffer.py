"""Scored groups waiting for the learner, taken oldest version first, with the policy version that sampled each, and
the admission rules a group passes to get here (prime-rl's TrainSink).

Staleness is decided here: a group more than `max_staleness` versions behind is handed back to be sampled
again, never trained on. With DAPO's dynamic sampling (`grpo.dynamic_sampling`), a group whose completions
all got the same reward is filtered (it would add no gradient) and kept aside as filler; at most
`max_oversampling` x unique_prompts prompts are handed out for one batch, and past that bound the batch is
completed with the freshest filler. A filtered prompt counts as used for its epoch (the `filtered` record)."""

from __future__ import annotations

from collections import deque

from tandem.services.orchestrator.epoch_record import RECENT, EpochRecord


class GroupBuffer:
    # refs and this batch's count (a resume hands their prompts out again), the recent list (in memory only)
    TRANSIENT = ("groups", "filler", "sampled", "recent_filtered")

    def __init__(self, max_staleness: int, rows: int = 0, dynamic_sampling: bool = False,
                 max_prompts: int | None = None):
        """max_prompts: dynamic sampling's bound on the prompts handed out for one batch."""
        self.k, self.dynamic, self.max_prompts = max_staleness, dynamic_sampling, max_prompts
        self.groups: list = []  # (meta, group ref); meta has index, epoch, version, tokens
        self.filler: list = []  # this batch's filtered groups (meta, ref): the fill when the bound is reached
        self.sampled = 0  # prompts handed out for the batch being gathered
        self.filtered = EpochRecord(rows, "filtered")
        self.recent_filtered: deque = deque(maxlen=RECENT)  # (epoch, index, version)

    def __len__(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------------------ admission

    def room(self, want: int, in_flight: int) -> int:
        """How many more prompts to hand out to keep `want` buffered or in flight (dynamic sampling: within the
        bound of this batch)."""
        room = want - len(self.groups) - in_flight
        return min(room, self.max_prompts - self.sampled) if self.dynamic else room

    def handed_out(self, n: int) -> None:
        self.sampled += n

    def admit(self, meta: dict, ref) -> bool:
        """A scored group: buffered, or (dynamic sampling, no reward variance) kept aside. -> buffered."""
        if self.dynamic and not meta.get("informative", True):
            self.filler.append((meta, ref))
            return False
        self.groups.append((meta, ref))
        return True


    def oversampled(self) -> bool:
        return self.dynamic and self.sampled >= self.max_prompts

    def fill(self, want: int, version: int) -> int:
        """The bound is reached: complete the batch with the freshest filler within the staleness bound
        (advantage 0: no gradient), or, without enough of it, allow more prompts. -> filler used."""
        fresh = [(m, r) for m, r in self.filler if version - m["version"] <= self.k]
        use = fresh[-(want - len(self.groups)):] if fresh else []
        self.groups += use
        ids = {id(r) for _, r in use}
        self.filler = [(m, r) for m, r in self.filler if id(r) not in ids]
        if len(self.groups) < want:  # every prompt failed or went stale: sample on rather than stall
            self.sampled = 0
        return len(use)

    # ---------------------------------------------------------------------------------- batch

    def drop_stale(self, version: int) -> list[dict]:
        """Metas of the groups too stale for a learner at `version`, removed."""
        stale = [m for m, _ in self.groups if version - m["version"] > self.k]
        self.groups = [(m, r) for m, r in self.groups if version - m["version"] <= self.k]
        return stale

    def take(self, n: int) -> list:
        """The next batch: the n groups sampled with the oldest versions (in arrival order within one), so a group
        that the next batch could not take any more is never left behind for a fresher one that could wait (taken in
        arrival order, a long group came back after fresher ones and was dropped stale: up to 11 whole groups in six
        steps of the 1.5B long tail at max_staleness 1, bench/results/e2e_gpu_scale.md, the H200 runs of
        2026-12-06). This batch's unused filler counts as used (filtered), and its bound starts again."""
        self.groups.sort(key=lambda g: g[0].get("version", 0))  # stable: arrival order within a version
        batch, self.groups = self.groups[:n], self.groups[n:]
        batch.sort(key=lambda g: g[0].get("group_id", 0))  # hand-out order, not arrival: a seeded job trains the same
        for m, _ in self.filler:
            self._record_filtered(m["epoch"], m["index"], m["version"])
        self.filler, self.sampled = [], 0
        return batch

    def _record_filtered(self, epoch: int, index: int, version: int) -> None:
        self.filtered.add(epoch, index)
        self.recent_filtered.append((epoch, index, version))

    def pending(self) -> list[tuple[int, int]]:
        return [(m["index"], m["epoch"]) for m, _ in self.groups]

    # ------------------------------------------------------------------------------ checkpoint

    def state(self) -> dict:
        """The filtered record, this batch's filler in it (its groups do not survive a restart: used, not trained)."""
        rec = EpochRecord(self.filtered.rows, "filtered")
        rec.load(self.filtered.state())
        for m, _ in self.filler:
            rec.add(m["epoch"], m["index"])
        return {"filtered": rec.state()}

    def load(self, st: dict) -> None:
        self.filtered.load(st["filtered"])
