"""Controller: drives one job. Hands prompts to rollout workers, collects group refs as each
worker finishes, forms generation batches, trains, publishes the adapter, checkpoints.

The controller moves object refs, never payloads: a worker's generate call returns one small
metadata object plus one ref per group, and the group refs go to the learner as they are.
Every prompt handed out is either returned as a group or re-queued (worker died, group too
stale): never lost, never trained on twice.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.core.plan import BatchPlan
from tandem.core.protocol import PromptItem
from tandem.services.checkpointer import Checkpointer
from tandem.services.data import check_rows, load_rows

MAX_REWARD_RETRIES = 1  # a prompt whose reward function failed is retried once, then recorded as failed


@dataclass
class Cursor:
    """Seeded shuffle per epoch; re-queued prompts go first."""

    n: int
    seed: int
    epoch: int = 0
    pos: int = 0
    requeued: deque = field(default_factory=deque)

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.n)

    def next(self) -> tuple[int, int]:
        """(dataset index, epoch it belongs to)."""
        if self.requeued:
            return self.requeued.popleft()
        if self.pos >= self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        idx = int(self.order(self.epoch)[self.pos])
        self.pos += 1
        return idx, self.epoch

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "requeued": [list(x) for x in self.requeued]}

    def load(self, st: dict) -> None:
        self.epoch, self.pos = st["epoch"], st["pos"]
        self.requeued = deque(tuple(x) for x in st["requeued"])


# metrics of the last optimizer step of each cycle exported as Ray metrics (the dashboard's Metrics
# page; Prometheus scrapes them as ray_<series_name>; deploy/grafana/tandem.json plots them)
EXPORTED = ("reward", "reward_std", "kl", "clip_ratio/region_mean", "completion_length", "loss", "entropy",
            "publish_latency_s", "queue_depth", "rollout_tokens_per_s", "version")


def series_name(key: str) -> str:
    return "tandem_" + key.replace("/", "_")


def one_at_a_time(method):
    """The Controller actor runs two threads (so `scale` and `status` are answered during a cycle):
    the methods that drive the job never run concurrently."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._drive:
            return method(self, *args, **kwargs)
    return run


class Controller:
    """Lifecycle: `Controller(cfg)` stores the job; `setup()` reads and tokenises the data and starts the
    learner and the rollout workers; `resume()` optionally; `step()` per generation cycle (saving when
    the checkpointer says so); `save_checkpoint()` at the end; `shutdown()`."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.plan = BatchPlan.from_config(cfg)
        self.out = Path(cfg.logging.output_dir)
        self.checkpoints = Checkpointer(cfg)
        self._drive = threading.Lock()
        self.version = 0
        self.cycle = 0
        self.total_cycles = 0  # known once setup has read the data
        self.next_group_id = 0
        self.workers: list = []
        self.target_workers = cfg.cluster.num_rollout_workers  # tandem scale sets it; applied between calls
        self.starting: dict = {}  # slot -> setup ref of a worker added by scale, not yet serving
        self.inflight: dict = {}  # call ref -> (worker slot, [PromptItem])
        self.outstanding = Counter()  # worker slot -> prompts in flight
        self.handed = Counter()  # worker slot -> prompts handed out so far (ties go to the least used)
        self.ready: list = []  # (meta, group ref), oldest first
        self.retries: Counter = Counter()
        self.seen: list[tuple[int, int, int]] = []  # (epoch, dataset index, version) of every trained group
        self.failed: list[dict] = []
        self.counters = Counter()
        self.adapter_ref = None
        self.metrics_path = self.out / "metrics.jsonl"
        self._gauges = None

    @one_at_a_time
    def setup(self, *, learner=None, workers=None) -> dict:
        import ray
        from transformers import AutoTokenizer

        from tandem.core.checks import check_inputs, write_shared_probe
        from tandem.rollout.prompts import tokenize_prompt
        from tandem.rollout.worker import start_rollout_worker

        cfg = self.cfg
        check_inputs(cfg)  # as this node sees them; each worker imports the rewards again in its setup
        self.out.mkdir(parents=True, exist_ok=True)
        rows = load_rows(cfg.data.path)
        check_rows(rows, cfg.data.prompt_column, cfg.data.path)
        tok = AutoTokenizer.from_pretrained(cfg.model.path)
        pc = cfg.data.prompt_column
        # Tokenised once, here; workers receive token ids.
        self.prompts = [tokenize_prompt(tok, r[pc], max_prompt_length=cfg.generation.max_prompt_length,
                                        truncate=cfg.data.truncate_long_prompts, row=i) for i, r in enumerate(rows)]
        self.rows = rows
        self.cursor = Cursor(len(rows), cfg.seed)
        if not cfg.data.shuffle:
            self.cursor.order = lambda epoch: np.arange(len(rows))
        U = self.plan.unique_prompts
        if cfg.batch.max_steps > 0:
            self.total_cycles = -(-cfg.batch.max_steps // self.plan.optimizer_steps_per_cycle)
        else:
            self.total_cycles = max(int(cfg.batch.num_train_epochs * len(rows)) // U, 1)
        self.total_steps = self.total_cycles * self.plan.optimizer_steps_per_cycle
        self.ray = ray
        if learner is None:
            from tandem.learner.group import LearnerGroup

            probe = write_shared_probe(cfg.logging.output_dir)
            try:
                learner = LearnerGroup(cfg, total_steps=self.total_steps, probe=probe)
            finally:
                Path(probe).unlink(missing_ok=True)
        if workers is None:
            started = [start_rollout_worker(cfg, i) for i in range(cfg.cluster.num_rollout_workers)]
            workers = [w for w, _ in started]
            ray.get([ref for _, ref in started])
        self.learner = learner
        self.workers = workers
        self.target_workers = len(workers)
        return self.status()

    # ------------------------------------------------------------------------------ workers

    def _item(self, idx: int, epoch: int) -> PromptItem:
        row = self.rows[idx]
        cols = {k: v for k, v in row.items() if k != self.cfg.data.prompt_column}
        it = PromptItem(self.next_group_id, idx, self.prompts[idx], row[self.cfg.data.prompt_column], cols,
                        queued_at=time.time())
        it.columns["_epoch"] = epoch  # carried back with the group
        self.next_group_id += 1
        return it

    def scale(self, n: int) -> dict:
        """Set the number of rollout workers of a live job (`tandem scale`). Applied between generate
        calls: new workers start with the current adapter; surplus ones (the last slots) get no new
        prompts and stop once their calls have returned, so no prompt is lost or handed out twice."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Controller.scale: num_rollout_workers = {n!r}; allowed a whole number >= 1")
        self.target_workers = n
        return self.status()

    def status(self) -> dict:
        return {"cycle": self.cycle, "total_cycles": self.total_cycles, "version": self.version,
                "workers": len(self.workers), "target_workers": self.target_workers,
                "in_flight": sum(self.outstanding.values()), "buffered": len(self.ready),
                "counters": dict(self.counters)}

    def _new_worker(self, slot: int):
        """A rollout worker for `slot`, started, with the current adapter queued (an actor runs its
        calls in order: before any generate). -> (actor, ref of the adapter call, else of setup)"""
        from tandem.rollout.worker import start_rollout_worker

        w, ready = start_rollout_worker(self.cfg, slot)
        return w, (w.set_adapter.remote(self.version, self.adapter_ref) if self.adapter_ref is not None else ready)

    def _apply_scale(self) -> None:
        while len(self.workers) < self.target_workers:
            w, ready = self._new_worker(len(self.workers))
            self.starting[len(self.workers)] = ready
            self.workers.append(w)
            self.counters["workers_added"] += 1
        busy = {slot for slot, _, _ in self.inflight.values()}
        while len(self.workers) > self.target_workers and len(self.workers) - 1 not in busy:
            self._stop_worker(len(self.workers) - 1)
            self.workers.pop()
            for table in (self.outstanding, self.handed, self.starting):
                table.pop(len(self.workers), None)
            self.counters["workers_removed"] += 1
        # a new worker serves once it has started (its resources may still be on their way)
        for slot, ref in list(self.starting.items()):
            if self.ray.wait([ref], timeout=0)[0]:
                del self.starting[slot]
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayError as e:
                    self.counters["worker_failures"] += 1
                    self._replace_worker(slot, e)

    def _stop_worker(self, slot: int) -> None:
        w = self.workers[slot]
        if slot not in self.starting:  # one still waiting for its resources has no engine to close
            try:
                self.ray.get(w.shutdown.remote(), timeout=30)  # engines first, so no shared memory leaks
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to stop
                pass
        self.ray.kill(w)

    def _dispatch(self, want: int) -> None:
        """Hand out prompts until `want` are buffered or in flight; the least-loaded worker first."""
        self._apply_scale()
        live = min(len(self.workers), self.target_workers)  # slots above the target drain
        per_call = max(1, -(-self.plan.unique_prompts // live))
        busy = {slot for slot, _, _ in self.inflight.values()}
        while len(self.ready) + sum(self.outstanding.values()) < want:
            free = [s for s in range(live) if s not in busy and s not in self.starting]
            if not free:
                return
            slot = min(free, key=lambda s: (self.outstanding[s], self.handed[s]))
            n = min(per_call, want - len(self.ready) - sum(self.outstanding.values()))
            items = [self._item(*self.cursor.next()) for _ in range(n)]
            refs = self.workers[slot].generate_refs.options(num_returns=n + 1).remote(items)
            self.inflight[refs[0]] = (slot, items, refs[1:])
            self.outstanding[slot] += n
            self.handed[slot] += n
            busy.add(slot)

    def _collect(self, timeout: float | None) -> None:
        """Take finished generate calls: groups to the buffer, failures handled, dead workers replaced."""
        if not self.inflight:
            return
        done, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=timeout)
        for ref in done:
            slot, items, group_refs = self.inflight.pop(ref)
            self.outstanding[slot] -= len(items)
            try:
                metas = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:  # worker died (or its results were lost)
                self.counters["worker_failures"] += 1
                for it in items:  # back to the front of the queue: nothing lost
                    self.cursor.requeued.appendleft((it.index, it.columns["_epoch"]))
                self._replace_worker(slot, e)
                continue
            for it, meta, gref in zip(items, metas, group_refs):
                self._accept(it, meta, gref)

    def _accept(self, it: PromptItem, meta: dict, gref) -> None:
        epoch = it.columns["_epoch"]
        if meta.get("failure"):
            self.counters["reward_failures"] += 1
            self.retries[(it.index, epoch)] += 1
            if self.retries[(it.index, epoch)] <= MAX_REWARD_RETRIES:
                self.cursor.requeued.append((it.index, epoch))
            else:
                self.failed.append({"index": it.index, "epoch": epoch, "message": meta["failure"]})
                with open(self.out / "failed_prompts.jsonl", "a") as f:
                    f.write(json.dumps(self.failed[-1]) + "\n")
                if len(self.failed) > max(4, len(self.rows) // 4):
                    raise RuntimeError(f"{len(self.failed)} prompts failed permanently; last: {meta['failure']}")
            return
        self.ready.append((dict(meta, index=it.index, epoch=epoch), gref))

    def _drop_stale(self) -> None:
        k = self.cfg.cluster.max_staleness
        keep = []
        for meta, gref in self.ready:
            if self.version - meta["version"] > k:
                self.counters["stale_dropped"] += 1
                self.cursor.requeued.append((meta["index"], meta["epoch"]))
            else:
                keep.append((meta, gref))
        self.ready = keep

    def _replace_worker(self, slot: int, err) -> None:
        try:
            self.ray.kill(self.workers[slot])
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.workers[slot], ready = self._new_worker(slot)
        self.ray.get(ready)

    # --------------------------------------------------------------------------------- cycle

    @one_at_a_time
    def step(self) -> dict:
        """One generation cycle: gather unique_prompts fresh groups, train, publish."""
        t0 = time.time()
        U = self.plan.unique_prompts
        k = self.cfg.cluster.max_staleness
        while True:
            self._drop_stale()
            if len(self.ready) >= U:
                break
            self._dispatch(U)
            self._collect(timeout=None)
        batch, self.ready = self.ready[:U], self.ready[U:]
        gen_s = time.time() - t0
        t1 = time.time()
        train_refs = self.learner.train_async([g for _, g in batch])
        while True:  # with max_staleness >= 1 the workers keep sampling while the learner trains
            if k > 0:
                self._dispatch(U * k)
            busy = k > 0 and self.inflight
            done, _ = self.ray.wait(train_refs, num_returns=len(train_refs), timeout=0.0 if busy else None)
            if len(done) == len(train_refs):
                break
            self._collect(timeout=0.05)
        result = self.ray.get(train_refs)[0]
        train_s = time.time() - t1
        for meta, _ in batch:
            self.seen.append((meta["epoch"], meta["index"], meta["version"]))
        t2 = time.time()
        self.version, self.adapter_ref = self.learner.export_adapter()
        self._publish()
        publish_s = time.time() - t2
        self.cycle += 1
        lags = Counter(self.version - 1 - m["version"] for m, _ in batch)
        extra = {
            "cycle": self.cycle, "generate_wait_s": gen_s, "train_s": train_s, "publish_latency_s": publish_s,
            "cycle_s": time.time() - t0, "queue_depth": len(self.ready) + sum(self.outstanding.values()),
            "staleness_hist": {str(k2): v for k2, v in sorted(lags.items())},
            "rollout_tokens_per_s": sum(m["tokens"] for m, _ in batch) / max(gen_s + train_s, 1e-9),
            **{f"count/{k2}": v for k2, v in self.counters.items()},
        }
        steps = [dict(s, **extra) for s in result["steps"]]
        self._log(steps)
        if self.checkpoints.due([s["step"] for s in steps]):
            self._save()
        return {"version": self.version, "steps": steps, "done": self.cycle >= self.total_cycles}

    # ------------------------------------------------------------------------------ metrics

    def _log(self, steps: list[dict]) -> None:
        with open(self.metrics_path, "a") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")
        try:
            from ray.util.metrics import Gauge

            if self._gauges is None:
                self._gauges = {}
            for key in EXPORTED:
                if key in steps[-1]:
                    name = series_name(key)
                    if name not in self._gauges:
                        self._gauges[name] = Gauge(name, description=f"Tandem {key} per optimizer step")
                    self._gauges[name].set(float(steps[-1][key]))
        except Exception:  # noqa: BLE001 - the dashboard is optional, the JSONL is the record
            pass

    # --------------------------------------------------------------------------- checkpoints

    def state(self) -> dict:
        # Prompts in flight or buffered were not trained on: on resume they are handed out again.
        pending = [(it.index, it.columns["_epoch"]) for _, items, _ in self.inflight.values() for it in items]
        pending += [(m["index"], m["epoch"]) for m, _ in self.ready]
        cur = self.cursor.state()
        cur["requeued"] = [list(p) for p in pending] + cur["requeued"]
        return {"cursor": cur, "cycle": self.cycle, "version": self.version, "next_group_id": self.next_group_id,
                "seen": self.seen, "failed": self.failed, "counters": dict(self.counters)}

    @one_at_a_time
    def save_checkpoint(self) -> str:
        return self._save()

    def _save(self) -> str:
        path = self.learner.save_checkpoint(self.checkpoints.path(self.cycle), {"controller": self.state()})
        self.checkpoints.prune()
        return path

    @one_at_a_time
    def resume(self) -> bool:
        latest = self.checkpoints.latest()
        if latest is None:
            return False
        meta = self.learner.load_checkpoint(str(latest))
        st = meta["controller"]
        self.cursor.load(st["cursor"])
        self.cycle, self.version, self.next_group_id = st["cycle"], st["version"], st["next_group_id"]
        self.seen = [tuple(x) for x in st["seen"]]
        self.failed, self.counters = st["failed"], Counter(st["counters"])
        if self.version > 0:
            self.version, self.adapter_ref = self.learner.export_adapter()
            self._publish()
        return True

    @one_at_a_time
    def shutdown(self) -> None:
        """Stop the rollout workers and the learner."""
        for slot in range(len(self.workers)):
            self._stop_worker(slot)
        self.learner.shutdown()

    def _publish(self) -> None:
        """Every worker serves the new version before the next cycle's prompts (dead ones are replaced)."""
        refs = [w.set_adapter.remote(self.version, self.adapter_ref) for w in self.workers]
        for slot, ref in enumerate(refs):
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                self.counters["worker_failures"] += 1
                self._replace_worker(slot, e)
