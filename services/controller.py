"""Controller: drives one job as a short loop over single-purpose parts that do not know about each
other (prime-rl's orchestrator; torchforge's two loops around a buffer):

  PromptSource   which prompt next (seeded order per epoch, re-queues, reward-failure retries)
  RolloutPool    the rollout workers: fed up to their prompts in flight, groups streamed back, scaling,
                 dead workers replaced, adapters published
  GroupBuffer    scored groups waiting for the learner; staleness decided there
  LearnerGroup   training (learner/)
  Checkpointer   when, where, how many, what to resume from
  RunLog         metrics.jsonl, the Ray metrics and the trackers of logging.report_to (Trackers)
  Evaluator      the eval prompts on the workers serving the newest adapter, every eval.eval_steps

The controller moves object refs, never payloads: a group goes from its worker's object store to the
learner's. Every prompt handed out is either trained on once or handed out again (worker died, group
too stale, reward function failed once): never lost, never trained on twice.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import Counter, deque
from pathlib import Path

from tandem.core.config import JobConfigError
from tandem.core.plan import BatchPlan
from tandem.core.protocol import PromptItem, errors_as_text
from tandem.services.checkpointer import Checkpointer, fingerprint, fingerprint_changes
from tandem.services.data import check_rows, load_rows
from tandem.services.epoch_record import EpochRecord
from tandem.services.evaluator import Evaluator
from tandem.services.group_buffer import GroupBuffer
from tandem.services.prompt_source import PromptSource, PromptTable
from tandem.services.rollout_pool import RolloutPool
from tandem.services.run_log import EXPORTED, RunLog, rollout_rates, series_name  # noqa: F401 - deploy/ reads EXPORTED
from tandem.services.trackers import Trackers

RECENT = 4096  # trained / filtered groups kept in memory with their versions


def one_at_a_time(method):
    """The Controller actor runs two threads (so `scale` and `status` are answered during a cycle):
    the methods that drive the job never run concurrently."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._drive:
            return method(self, *args, **kwargs)
    return run


class CycleInterrupted(Exception):
    """The driver asked the cycle to stop (Ctrl-C, SIGTERM): what it gathered stays pending."""


@errors_as_text
class Controller:
    """Lifecycle: `Controller(cfg, own_process)` stores the job (own_process: a Ray actor of its own, which
    tokenises without importing torch); `setup()` reads and tokenises the data and starts the
    learner and the rollout workers; `resume()` optionally; `step()` per generation cycle (saving when
    the checkpointer says so); `save_checkpoint()` at the end; `shutdown()`."""

    def __init__(self, cfg, own_process: bool = False):
        self.cfg, self.own_process = cfg, own_process
        self.plan = BatchPlan.from_config(cfg)
        self.k = cfg.cluster.max_staleness
        self.out = Path(cfg.logging.output_dir)
        self.checkpoints = Checkpointer(cfg)
        self.log = RunLog(self.out / "metrics.jsonl")
        self.buffer = GroupBuffer(self.k)
        self.counters = Counter()
        self._drive = threading.Lock()
        self._interrupted = threading.Event()
        self.version = self.cycle = self.total_cycles = 0
        # (epoch, dataset index, version) of the latest trained / dynamic-sampling-filtered groups, for the
        # metrics and a reader; what was used in each epoch is kept whole, and bounded, in EpochRecords
        self.seen: deque = deque(maxlen=RECENT)
        self.filtered: deque = deque(maxlen=RECENT)
        self.failed: list[dict] = []
        self._filler: list = []  # this batch's filtered groups, to fill it when the oversampling bound is hit
        self._sampled = 0  # prompts handed out for the batch being gathered
        self._no_reward_run = 0  # groups in a row without any reward: a cycle's worth stops the run
        self.pool = self.learner = None
        self.evaluator = None
        self._publish_latency = 0.0
        self.notes: list[str] = []  # what resume() passed over (checkpoints, a cut metrics line), for the terminal

    @one_at_a_time
    def setup(self, resource_wait_s: float = 0.0) -> dict:
        """resource_wait_s: how long a request no node can hold may wait for an autoscaler to add one."""
        from tandem.core.checks import check_inputs, write_shared_probe
        from tandem.core.compat import tokenizer_without_torch
        from tandem.learner.group import LearnerGroup
        from tandem.rollout.prompts import tokenize_prompt
        from tandem.rollout.worker import prompts_in_flight
        from tandem.services.colocated import PREFIX, colocated_actor_class, worker_starter

        cfg = self.cfg
        check_inputs(cfg)  # as this node sees them; each worker imports the rewards again in its setup
        if cfg.logging.overwrite_output_dir and not cfg.checkpoint.resume:
            self._clear_run_dir()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.own_process:  # a Ray actor of its own: nothing here runs a model
            tok = tokenizer_without_torch(cfg.model.path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(cfg.model.path)
        pc = cfg.data.prompt_column

        def table(path: str) -> PromptTable:  # tokenised once, here; workers receive token ids
            rows = load_rows(path)
            check_rows(rows, pc, path)
            return PromptTable(rows, [tokenize_prompt(tok, r[pc], max_prompt_length=cfg.generation.max_prompt_length,
                                                      truncate=cfg.data.truncate_long_prompts, row=i)
                                      for i, r in enumerate(rows)], pc)
        self.table = table(cfg.data.path)
        rows = self.table.rows
        self.source = PromptSource(len(rows), cfg.seed, cfg.data.shuffle)
        self.trained, self.filtered_record = EpochRecord(len(rows), "trained on"), EpochRecord(len(rows), "filtered")
        self.fingerprint = fingerprint(cfg, len(rows))
        if cfg.eval.path is not None:
            self.evaluator = Evaluator(cfg, table(cfg.eval.path), tok)
        U = self.plan.unique_prompts
        if cfg.batch.max_steps > 0:
            self.total_cycles = -(-cfg.batch.max_steps // self.plan.optimizer_steps_per_cycle)
        else:
            self.total_cycles = max(int(cfg.batch.num_train_epochs * len(rows)) // U, 1)
        self.total_steps = self.total_cycles * self.plan.optimizer_steps_per_cycle
        self._wait_for_nodes(resource_wait_s)
        probe = write_shared_probe(cfg.logging.output_dir)
        try:  # the learner's setup runs while the rollout workers start
            colocate = cfg.cluster.vllm_mode == "colocate"  # rank 0's actor is rollout worker 0
            host = dict(actor_class=colocated_actor_class(cfg), prefix=PREFIX) if colocate else {}
            self.learner = LearnerGroup(cfg, total_steps=self.total_steps, probe=probe, wait=False, **host)
            start = worker_starter(cfg, host=self.learner.actors[0] if colocate else None)
            self.pool = RolloutPool(start, prompts_in_flight(cfg), self.counters)
            self.pool.start(cfg.cluster.num_rollout_workers)
            self.learner.ready()
        finally:
            Path(probe).unlink(missing_ok=True)
        self.log.trackers = Trackers(cfg)
        return self.status()

    def _wait_for_nodes(self, wait_s: float) -> None:
        """Every role's request fits some node (within wait_s), or a one-line error: an actor that no node
        can hold would wait forever, and the job and `tandem status` with it."""
        import ray

        from tandem.core.checks import resource_errors

        end = time.time() + wait_s
        while errors := resource_errors(self.cfg, ray.nodes()):
            if time.time() >= end:
                raise JobConfigError("invalid job: " + "; ".join(errors) +
                                     (f" (waited {wait_s:.0f} s for a node to join)" if wait_s else ""))
            time.sleep(2)

    def _clear_run_dir(self) -> None:
        """overwrite_output_dir: the earlier run's record and checkpoints go before this one writes."""
        import shutil

        for name in ("metrics.jsonl", "failed_prompts.jsonl"):
            (self.out / name).unlink(missing_ok=True)
        for d in (Path(self.cfg.checkpoint_dir), self.out / "adapter", self.out / "model"):
            shutil.rmtree(d, ignore_errors=True)

    @property
    def workers(self) -> list:
        return self.pool.workers if self.pool else []

    # --------------------------------------------------------------------------------- cycle

    @one_at_a_time
    def step(self) -> dict:
        """One generation cycle: gather unique_prompts fresh groups, train on them, publish the adapter."""
        ray = self.pool.ray
        if self.cycle == 0 and self.evaluator and self.cfg.eval.eval_on_start and not self.log.has_step(0):
            self.log.write([{"step": 0, **self.evaluator.run(ray, self.pool.serving(), self.version, 0)}])
        t0 = time.time()
        U = self.plan.unique_prompts
        before = self._rollout_stats()
        filled = 0
        while True:
            if self._interrupted.is_set():  # before training: nothing of this cycle is trained or lost
                raise CycleInterrupted(f"cycle {self.cycle} interrupted while gathering groups")
            self._requeue_stale()
            if len(self.buffer) >= U:
                break
            if self._oversampled(U) and not self.pool.in_flight():
                filled = self._fill(U)
                continue
            self._gather(U, timeout=1.0)
        batch = self.buffer.take(U)
        sampled, self._sampled = self._sampled, 0
        for m, _ in self._filler:  # used, not trained
            self._record_filtered(m)
        self._filler = []
        wait_s = time.time() - t0
        t1 = time.time()
        train_refs = self.learner.train_async([g for _, g in batch])
        while True:  # with max_staleness >= 1 the workers keep sampling while the learner trains
            if self.k > 0:
                self._gather(U * self.k, timeout=0.05)
            busy = self.k > 0 and self.pool.in_flight()
            done, waiting = ray.wait(train_refs, num_returns=len(train_refs), timeout=0.0 if busy else 0.5)
            ray.get(done)  # a dead rank raises now, not after the others time out at a collective
            if not waiting:
                break
        result = ray.get(train_refs)[0]
        train_s = time.time() - t1
        for m, _ in batch:
            self.trained.add(m["epoch"], m["index"])
            self.seen.append((m["epoch"], m["index"], m["version"]))
        # Publishing waits for no generation: each worker loads the adapter between two engine steps while
        # its requests run on, so every worker serves the new version before the next cycle begins (with
        # max_staleness 0, before any of its prompts goes out).
        t2 = time.time()
        self._publish()
        self.cycle += 1
        done_run = self.cycle >= self.total_cycles
        publish_s = time.time() - t2
        steps = self._metrics(result["steps"], batch, before, wait_s=wait_s, train_s=train_s, publish_s=publish_s,
                              cycle_s=time.time() - t0)
        if self.evaluator and self.evaluator.due(steps[0]["step"], steps[-1]["step"], done_run):
            steps[-1].update(self.evaluator.run(ray, self.pool.serving(), self.version, steps[-1]["step"]))
        if self.cfg.grpo.dynamic_sampling:
            steps = [dict(st, **{"dynamic_sampling/prompts_sampled": sampled, "dynamic_sampling/filled": filled})
                     for st in steps]
        self.log.write(steps)
        if self.checkpoints.due([s["step"] for s in steps]):
            self._save()
        return {"version": self.version, "steps": steps, "done": done_run}

    def _item(self) -> PromptItem:
        return self.table.item(*self.source.next())

    def _gather(self, want: int, timeout: float) -> None:
        """Keep `want` prompts buffered or in flight, take what came back within `timeout`."""
        room = want - len(self.buffer) - self.pool.in_flight()
        if self.cfg.grpo.dynamic_sampling:
            room = min(room, int(self.cfg.grpo.max_oversampling * self.plan.unique_prompts) - self._sampled)
        if room > 0:
            self._sampled += self.pool.feed(self._item, room)
        results, lost = self.pool.poll(timeout=timeout)
        for it in lost:  # back to the front of the queue: nothing lost
            self.source.requeue(it.index, it.epoch, front=True)
        for it, meta, ref in results:
            self._accept(it, meta, ref)

    def _accept(self, it: PromptItem, meta: dict, ref) -> None:
        if not meta.get("failure"):
            self._no_reward_run = 0
            m = dict(meta, index=it.index, epoch=it.epoch)
            if self.cfg.grpo.dynamic_sampling and not meta.get("informative", True):
                self.counters["groups_filtered"] += 1
                self._filler.append((m, ref))
            else:
                self.buffer.add(m, ref)
            return
        if meta.get("no_reward"):  # the functions' answer, not a failure: recorded at once, never retried
            self.counters["groups_no_reward"] += 1
            self._record_failed(it, meta["failure"], "no_reward")
            self._no_reward_run += 1
            if self._no_reward_run >= self.plan.unique_prompts:
                raise JobConfigError(
                    f"rewards = {self.cfg.rewards}: returned None for every completion of the last "
                    f"{self._no_reward_run} prompts, a whole generation cycle: nothing to train on (each recorded in "
                    f"{self.out / 'failed_prompts.jsonl'}); allowed: reward functions that return a number for at "
                    "least some completions (None skips a sample)")
            return
        self.counters["reward_failures"] += 1
        if not self.source.retry(it.index, it.epoch):
            self._record_failed(it, meta["failure"], "reward_error")
            if sum(f.get("reason") != "no_reward" for f in self.failed) > max(4, len(self.table) // 4):
                raise RuntimeError(f"{len(self.failed)} prompts failed permanently; last: {meta['failure']}")

    def _record_failed(self, it: PromptItem, message: str, reason: str) -> None:
        self.failed.append({"index": it.index, "epoch": it.epoch, "reason": reason, "message": message})
        with open(self.out / "failed_prompts.jsonl", "a") as f:
            f.write(json.dumps(self.failed[-1]) + "\n")

    def _record_filtered(self, m: dict) -> None:
        self.filtered_record.add(m["epoch"], m["index"])
        self.filtered.append((m["epoch"], m["index"], m["version"]))

    def _oversampled(self, U: int) -> bool:
        return self.cfg.grpo.dynamic_sampling and self._sampled >= int(self.cfg.grpo.max_oversampling * U)

    def _fill(self, U: int) -> int:
        """The oversampling bound is reached: the batch is completed with the freshest filtered groups
        (advantage 0: they add no gradient), or, without enough of them, more prompts are allowed."""
        fresh = [(m, r) for m, r in self._filler if self.version - m["version"] <= self.k]
        use = fresh[-(U - len(self.buffer)):] if fresh else []
        for m, r in use:
            self.buffer.add(m, r)
        ids = {id(r) for _, r in use}
        self._filler = [(m, r) for m, r in self._filler if id(r) not in ids]
        if len(self.buffer) < U:  # every prompt failed or went stale: sample on rather than stall
            self._sampled = 0
        self.counters["groups_filled"] += len(use)
        return len(use)

    def _requeue_stale(self) -> None:
        for m in self.buffer.drop_stale(self.version):
            self.counters["stale_dropped"] += 1
            self.source.requeue(m["index"], m["epoch"])

    def _publish(self) -> None:
        """The learner's newest adapter to every worker; publish_latency_s: from its export to every worker
        serving it. Prompts a worker that died on it held are handed out again."""
        self.version, adapter_ref = self.learner.export_adapter()
        exported = time.time()
        sent = self.pool.send(self.version, adapter_ref)
        if self.k > 0 and self.cycle + self.k + 1 < self.total_cycles:  # (not past the last cycle)
            # the cycle k + 1 ahead goes out now, for this version: each worker starts it the moment it
            # serves it, instead of idling for a round trip to here (an engine serving one version drains first)
            self._gather(self.plan.unique_prompts * (self.k + 1), timeout=0.0)
        for it in self.pool.wait_published(sent):
            self.source.requeue(it.index, it.epoch, front=True)
        self._publish_latency = time.time() - exported

    # ------------------------------------------------------------------------------ metrics

    def _rollout_stats(self) -> dict:
        return {"t": time.time(), "workers": {s["worker"]: s for s in self.pool.stats()}}

    def _metrics(self, steps, batch, before, **times) -> list[dict]:
        lags = Counter(self.version - 1 - m["version"] for m, _ in batch)
        extra = {
            "cycle": self.cycle, "generate_wait_s": times["wait_s"], "train_s": times["train_s"],
            "publish_s": times["publish_s"],  # export + publish
            "publish_latency_s": self._publish_latency,  # from the export to every worker serving it
            "cycle_s": times["cycle_s"],
            "queue_depth": len(self.buffer) + self.pool.in_flight(), "prompts_in_flight": self.pool.in_flight(),
            "staleness_hist": {str(k): v for k, v in sorted(lags.items())},
            **rollout_rates(before, self._rollout_stats()),
            **{f"count/{k}": v for k, v in self.counters.items()},
        }
        return [dict(s, **extra) for s in steps]

    # ------------------------------------------------------------------------------- control

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: the cycle in progress stops gathering (a cycle already training finishes its
        training first), so that a checkpoint is written within seconds, not after a slow generation."""
        self._interrupted.set()

    def scale(self, n: int) -> dict:
        """Set the number of rollout workers of a live job (`tandem scale`); applied at the next feed."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Controller.scale: num_rollout_workers = {n!r}; allowed a whole number >= 1")
        self.pool.scale(n)
        return self.status()

    def status(self) -> dict:
        return {"cycle": self.cycle, "total_cycles": self.total_cycles, "version": self.version,
                "workers": len(self.pool.slots) if self.pool else 0,
                "target_workers": self.pool.target if self.pool else 0,
                "in_flight": self.pool.in_flight() if self.pool else 0, "buffered": len(self.buffer),
                "counters": dict(self.counters)}

    # --------------------------------------------------------------------------- checkpoints

    def state(self) -> dict:
        # Prompts in flight or buffered were not trained on: on resume they are handed out again.
        pending = [(it.index, it.epoch) for it in self.pool.pending_items()] + self.buffer.pending()
        return {"fingerprint": self.fingerprint, "cursor": self.source.state(pending), "cycle": self.cycle,
                "version": self.version,
                "next_group_id": self.table.next_group_id, "trained": self.trained.state(), "failed": self.failed,
                "filtered": self.filtered_record.state(),
                "filler": [(m["epoch"], m["index"], m["version"]) for m, _ in self._filler],  # filtered too
                "counters": dict(self.counters)}

    @one_at_a_time
    def save_checkpoint(self) -> str:
        return self._save()

    def _save(self) -> str:
        path = self.learner.save_checkpoint(self.checkpoints.path(self.cycle), {"controller": self.state()})
        self.checkpoints.prune()
        return path

    @one_at_a_time
    def resume(self) -> str | None:
        """Continue from the newest checkpoint that loads; the metrics of steps after it are cut from metrics.jsonl.
        Each checkpoint skipped (newer than the one resumed from) is set aside as `<name>.refused` and named in
        `self.notes`, as is a metrics line a crash cut (the driver prints them); when checkpoints exist and none
        loads, the run is refused. -> the path resumed from, or None when there is no checkpoint."""
        skipped = []
        for ck, why in self.checkpoints.candidates():
            if why is None:
                meta = json.loads((ck / "tandem.json").read_text())
                saved = meta["controller"].get("fingerprint")  # none in checkpoints older than fingerprints
                changed = fingerprint_changes(saved, self.fingerprint) if saved else []
                if changed and not self.cfg.checkpoint.allow_changed_job:
                    raise JobConfigError(f"checkpoint.resume: {ck} was written by a different job: "
                                         f"{'; '.join(changed)}; allowed: the same data, seed, model and training "
                                         "settings, or checkpoint.allow_changed_job: true")
                try:
                    meta = self.learner.load_checkpoint(str(ck))
                except Exception as e:  # noqa: BLE001 - a part DeepSpeed cannot read: the older one may do
                    why = f"failed to load: {(str(e).strip().splitlines() or [type(e).__name__])[-1][:200]}"
            if why is not None:
                skipped.append((ck, why))
                continue
            self.notes = [f"checkpoint {c.name} skipped: {w}; kept as {self.checkpoints.set_aside(c).name}"
                          for c, w in skipped]
            self._restore(meta["controller"])
            self.log.cut_back(meta["steps"])
            self.notes += self.log.cut
            return str(ck)
        if skipped:
            raise JobConfigError(f"checkpoint.resume: no checkpoint in {self.checkpoints.root} can be resumed from: " +
                                 "; ".join(f"{ck.name} ({why})" for ck, why in skipped) +
                                 "; allowed: repair or remove them, or logging.overwrite_output_dir: true to start over")
        self.log.cut_back(0)  # steps a run that died before its first checkpoint logged are trained again
        self.notes = self.log.cut
        return None

    def _restore(self, st: dict) -> None:
        self.source.load(st["cursor"])
        self.cycle, self.version, self.table.next_group_id = st["cycle"], st["version"], st["next_group_id"]
        n = len(self.table)
        if "trained" in st:
            self.trained.load(st["trained"])
            self.filtered_record.load(st["filtered"])
            for e, i, v in st["filler"]:
                self._record_filtered({"epoch": e, "index": i, "version": v})
        else:  # a checkpoint from before the records: lists of (epoch, index, version)
            self.trained = EpochRecord.from_pairs(n, st["seen"])
            self.filtered_record = EpochRecord.from_pairs(n, st.get("filtered", []), "filtered")
        self.failed = st["failed"]
        self.counters.clear()
        self.counters.update(st["counters"])
        if self.version > 0:
            self._publish()

    @one_at_a_time
    def shutdown(self) -> None:
        """Stop the rollout workers and the learner."""
        if self.pool:
            self.pool.shutdown()
        if self.log.trackers is not None:
            self.log.trackers.close()
        if self.learner is not None:
            self.learner.shutdown()
