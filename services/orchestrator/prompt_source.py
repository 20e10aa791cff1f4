"""The order prompts are handed out in: a seeded shuffle per epoch (O(1) per prompt: one permutation
per epoch, not one per call), re-queued prompts first; reward-failure, worker-death and staleness retries counted
here."""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from tandem.core.protocol import PromptItem

MAX_REWARD_RETRIES = 1  # a prompt whose reward function failed is retried once, then recorded as failed
MAX_WORKER_DEATHS = 1  # a prompt held by a worker that died is handed out again once; a second death fails it
# A prompt whose group went past max_staleness (stopped mid-sampling, or back too late to be taken) is handed out
# again once in its epoch, once a newer version than the one it was held at serves (`next`): sampled with it, it has
# all the k + 1 cycles the bound gives (handed out at once, it was sampled with the version about to be replaced, and
# had one cycle less). The second time it is recorded as not trained that epoch. Re-queued first every time, such
# prompts (the long tail of lengths at a small bound) came to fill the engine, each stopped again: on the 1.5B long
# tail at max_staleness 1 the step grew from 5 to 22 s within six steps (bench/results/e2e_gpu_scale.md, the H200 runs
# of 2026-12-06).
MAX_STALE = 1


class PromptSource:
    """table: the PromptTable whose rows it hands out (`next_item`); without one, `next` gives (index, epoch)."""

    # counts start again on resume; the order is recomputed; the held prompts are saved first among the re-queued ones
    # (a resume publishes before it hands out any prompt, so they are sampled with the newest version as if released)
    TRANSIENT = ("retries", "deaths", "stale", "held", "_order")

    def __init__(self, n: int, seed: int, shuffle: bool = True, table: PromptTable | None = None):
        self.n, self.seed, self.shuffle, self.table = n, seed, shuffle, table
        self.epoch, self.pos = 0, 0
        self.requeued: deque = deque()  # (dataset index, epoch), handed out before new ones
        self.held: deque = deque()  # (dataset index, epoch, version served) past max_staleness once: see next()
        self.retries: Counter = Counter()
        self.deaths: Counter = Counter()  # (index, epoch) -> workers that died holding it
        self.stale: Counter = Counter()  # (index, epoch) -> its groups that went past max_staleness
        self._order: tuple[int, np.ndarray] | None = None

    def next_item(self, version: int) -> PromptItem:
        """The next prompt, to be sampled with policy `version` (what the rollout workers serve now)."""
        return self.table.item(*self.next(version))

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.n) if self.shuffle else np.arange(self.n)
            self._order = (epoch, perm)
        return self._order[1]

    def next(self, version: int | None = None) -> tuple[int, int]:
        """(dataset index, epoch it belongs to). version: the policy version it will be sampled with; the prompts held
        past the staleness bound at an older one go first (None: none released)."""
        released = []
        while version is not None and self.held and self.held[0][2] < version:
            released.append(self.held.popleft()[:2])
        self.requeued.extendleft(reversed(released))
        if self.requeued:
            return self.requeued.popleft()
        if self.pos >= self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        idx = int(self.order(self.epoch)[self.pos])
        self.pos += 1
        return idx, self.epoch

    def requeue(self, index: int, epoch: int, front: bool = False) -> None:
        (self.requeued.appendleft if front else self.requeued.append)((index, epoch))

    def retry(self, index: int, epoch: int) -> bool:
        """After a reward failure: re-queued (True) or out of retries (False: record it as failed)."""
        return self._again(self.retries, MAX_REWARD_RETRIES, index, epoch, self.requeue)

    def died_with_worker(self, index: int, epoch: int) -> bool:
        """After the worker holding it died: handed out again first (True) or out of chances (False: record it as
        failed, it is likely what kills the worker)."""
        return self._again(self.deaths, MAX_WORKER_DEATHS, index, epoch, lambda i, e: self.requeue(i, e, front=True))

    def went_stale(self, index: int, epoch: int, version: int) -> bool:
        """After its group went past max_staleness (stopped mid-sampling, or back too late) while the workers serve
        `version`: held until a newer one serves (True) or out of chances (False: record it as not trained this epoch;
        its group takes longer than the bound allows)."""
        return self._again(self.stale, MAX_STALE, index, epoch, lambda i, e: self.held.append((i, e, version)))

    @staticmethod
    def _again(counts: Counter, most: int, index: int, epoch: int, put) -> bool:
        counts[(index, epoch)] += 1
        if counts[(index, epoch)] <= most:
            put(index, epoch)
            return True
        return False

    def state(self, pending: list[tuple[int, int]] = ()) -> dict:
        """`pending`: prompts handed out but not trained: handed out again first on resume, then the held ones."""
        st = {"epoch": self.epoch, "pos": self.pos,
              "requeued": [list(p) for p in pending] + [list(x[:2]) for x in (*self.held, *self.requeued)]}
        return st if self.table is None else dict(st, next_group_id=self.table.next_group_id)

    def load(self, st: dict) -> None:
        self.epoch, self.pos = st["epoch"], st["pos"]
        self.requeued = deque(tuple(x) for x in st["requeued"])
        self.held.clear()
        if self.table is not None:
            self.table.next_group_id = st["next_group_id"]


class PromptTable:
    """The dataset's rows with their prompts tokenised once; makes the PromptItem a worker receives (a
    fresh group id per hand-out: a re-queued prompt gets a new one)."""

    def __init__(self, rows: list[dict], token_ids: list, prompt_column: str):
        self.rows, self.token_ids, self.pc = rows, token_ids, prompt_column
        self.next_group_id = 0

    def __len__(self) -> int:
        return len(self.rows)

    def item(self, index: int, epoch: int) -> PromptItem:
        row = self.rows[index]
        it = PromptItem(self.next_group_id, index, self.token_ids[index], row[self.pc],
                        {k: v for k, v in row.items() if k != self.pc}, epoch=epoch)
        self.next_group_id += 1
        return it
