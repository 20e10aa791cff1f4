"""Controller: drives one job as a short loop over single-purpose parts that do not know about each
other (prime-rl's orchestrator; torchforge's two loops around a buffer):

  PromptSource   which prompt next (seeded order per epoch, re-queues, reward-failure retries), from its table
  RolloutPool    the rollout workers: fed up to their prompts in flight, groups streamed back, scaling,
                 dead workers replaced, adapters published
  GroupBuffer    scored groups waiting for the learner: staleness and admission (dynamic sampling) decided there
  Intake         what the workers hand back, sorted: into the buffer, handed out again, or recorded as
                 failed (its FailureLog: failed_prompts.jsonl)
  TrainedRecord  what was trained, per epoch
  LearnerGroup   training (learner/)
  Checkpointer   when, where, how many, what to resume from
  RunLog         metrics.jsonl, the Ray metrics and the trackers of logging.report_to (Trackers)
  Evaluator      the eval prompts on the workers serving the newest adapter, every eval.eval_steps
  pipeline       how many prompts max_staleness lets out, and when the next batch may train ahead (pure)

Each part that holds run state saves and loads its own share (state / load); the controller's checkpoint
state is the dict of those. The controller moves object refs, never payloads: a group goes from its worker's
object store to the learner's. Every prompt handed out is trained on once, handed out again (worker died, group
too stale, reward function failed once), or recorded in failed_prompts.jsonl (the second time of each): never lost,
never trained on twice.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tandem.core.engine_memory import oversample_prompts, token_lag_bound
from tandem.core.errors import LearnerLost
from tandem.core.plan import BatchPlan
from tandem.core.protocol import errors_as_text
from tandem.core.storage import run_mirror
from tandem.services.orchestrator.autoscale import (
    CycleLoad,
    autoscale,
    request_job_resources,
    request_rollout_resources,
    wait_for_nodes,
)
from tandem.services.orchestrator.checkpointer import (
    Checkpointer,
    clear_run_dir,
    fingerprint,
)
from tandem.services.orchestrator.colocated import start_actors
from tandem.services.orchestrator.data import read_job_data
from tandem.services.orchestrator.epoch_record import EpochRecord, TrainedRecord
from tandem.services.orchestrator.evaluator import Evaluator
from tandem.services.orchestrator.failures import FailureLog
from tandem.services.orchestrator.group_buffer import GroupBuffer
from tandem.services.orchestrator.intake import Intake
from tandem.services.orchestrator.pipeline import (
    prompts_wanted,
    trained_ahead_allowed,
)
from tandem.services.orchestrator.prompt_source import PromptSource
from tandem.services.orchestrator.rollout_pool import RolloutPool, lost_object
from tandem.services.orchestrator.run_log import RunLog, cycle_lines
from tandem.services.orchestrator.trackers import Trackers
from tandem.services.orchestrator.trl_checkpoint import Epochs, write_trl_checkpoint

NOTICES: collections.deque = collections.deque(maxlen=100)  # said since the driver last asked (step() hands them on)


def say(line: str) -> None:
    """One line for the terminal of whoever runs the job: in the actor's log, and handed to the driver with the
    cycle's result (the drivers run Ray with log_to_driver off: the actors' own output stays in their logs)."""
    import sys

    sys.stderr.write(line + "\n")  # one write: Ray's log thread, printing to the same stream, cannot split it
    sys.stderr.flush()
    NOTICES.append(line)


def notices() -> list[str]:
    """The lines said since the last call."""
    out = []
    while NOTICES:
        out.append(NOTICES.popleft())
    return out


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


@dataclass
class Training:
    """A batch handed to the learner: its groups (meta, ref), dynamic sampling's counts, the ranks' result refs."""

    batch: list
    sampled: dict
    refs: list


@dataclass
class Progress:
    """Where the run is: generation cycles done and the policy version served (saved), its length (from the
    job and the data), the last publish's latency, and the batch training ahead of the cycle count, if any."""

    TRANSIENT: ClassVar = ("total_cycles", "total_steps", "publish_latency_s", "training", "all_taken", "last_take",
                           "interrupted")
    cycle: int = 0
    version: int = 0
    total_cycles: int = 0
    total_steps: int = 0
    publish_latency_s: float = 0.0  # from the adapter's send to every worker serving it
    training: Training | None = None  # the next cycle's batch, training ahead of it (never saved: a save drains it)
    all_taken: bool = False  # the run's last batch is taken: what is still sampling is left for a resume
    last_take: float | None = None  # when the last batch whose metrics were written was taken (run_log.sampling_times)
    interrupted: threading.Event = field(default_factory=threading.Event)  # the driver asked the run to stop

    def state(self) -> dict:
        return {"cycle": self.cycle, "version": self.version}

    def load(self, st: dict) -> None:
        self.cycle, self.version = st["cycle"], st["version"]


@dataclass
class Stages:
    """A cycle's stages, each timed under its name (verl's marked_timer): the metrics' cycle split."""

    t0: float = field(default_factory=time.time)
    seconds: dict = field(default_factory=Counter)

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.time()
        try:
            yield
        finally:
            self.seconds[name] += time.time() - t


@errors_as_text
class Controller:
    """Lifecycle: `Controller(cfg)` stores the job; `setup(resource_wait_s, own_process)` reads and tokenises
    the data and starts the learner and the rollout workers (own_process: a Ray actor of its own, which
    tokenises without importing torch); `resume()` optionally; `step()` per generation cycle (saving when the
    checkpointer says so); `save_checkpoint()` at the end; `shutdown()`."""

    def __init__(self, cfg, datasets: dict | None = None):
        # the job; datasets: {"data" | "eval": rows, or a Ray reference to them} given from Python (GRPOTrainer)
        self.cfg, self.plan, self.datasets = cfg, BatchPlan.from_config(cfg), dict(datasets or {})
        # run state, each part saving its own (state / load); the data-bound ones are made in setup
        self.progress, self.counters = Progress(), Counter()
        self.source: PromptSource | None = None
        self.buffer: GroupBuffer | None = None
        self.record: TrainedRecord | None = None
        self.intake: Intake | None = None
        # the actors, the files
        self.pool: RolloutPool | None = None
        self.learner = self.evaluator = None
        self.checkpoints = Checkpointer(cfg)
        self.log = RunLog(self.out / "metrics.jsonl", cfg.logging.group_trace)
        self._drive = threading.Lock()  # one driving call at a time (a second thread answers status and scale)

    # what tests, the driver and a reader ask for by name
    out = property(lambda self: Path(self.cfg.run_dir))  # this node's: output_dir, or its staging directory
    cycle = property(lambda self: self.progress.cycle)
    version = property(lambda self: self.progress.version)
    total_cycles = property(lambda self: self.progress.total_cycles)
    table = property(lambda self: self.source.table)
    trained = property(lambda self: self.record.epochs)  # what was trained, per epoch
    seen = property(lambda self: self.record.recent)  # (epoch, index, version) of the latest trained groups
    filtered = property(lambda self: self.buffer.recent_filtered)  # the same of the latest filtered ones
    workers = property(lambda self: self.pool.workers if self.pool else [])

    @one_at_a_time
    def setup(self, resource_wait_s: float = 0.0, own_process: bool = False) -> dict:
        """resource_wait_s: how long a request no node can hold may wait for an autoscaler to add one."""
        from tandem.core.checks import check_inputs

        cfg = self.cfg
        check_inputs(cfg, given=set(self.datasets))  # as this node sees them; each worker imports the rewards again
        if cfg.logging.overwrite_output_dir and not cfg.checkpoint.resume:
            clear_run_dir(cfg)
        self.log.mirror = run_mirror(cfg)
        if self.log.mirror:
            self.log.mirror.pull()  # a resumed run's record, to cut back and append to
        self.out.mkdir(parents=True, exist_ok=True)
        data, evals, tok, content = read_job_data(cfg, self.datasets, own_process, say)
        self.source, rows = PromptSource(len(data), cfg.seed, cfg.data.shuffle, table=data), len(data)
        self.evaluator = Evaluator(cfg, evals, tok) if evals is not None else None
        bound = token_lag_bound(cfg)  # in flight, a group goes only when the loss would mask all of it
        self.buffer = GroupBuffer(cfg.cluster.max_staleness if bound is None else bound, rows, cfg.grpo.dynamic_sampling,
                                  int(cfg.grpo.max_oversampling * self.plan.unique_prompts))
        self.record = TrainedRecord(rows)
        failures = FailureLog(self.out / "failed_prompts.jsonl", cfg.rewards, self.plan.unique_prompts, rows, say)
        self.intake = Intake(cfg, self.source, self.buffer, failures, self.log, self.counters)
        self.checkpoints.fingerprint = fingerprint(cfg, rows, content)
        p = self.progress
        p.total_cycles = self.plan.total_cycles(cfg.batch.max_steps, cfg.batch.num_train_epochs, rows)
        p.total_steps = p.total_cycles * self.plan.optimizer_steps_per_cycle
        if cfg.checkpoint.resume:
            self.checkpoints.refuse_if_none_readable()  # in a second, not after every actor started
        if cfg.cluster.autoscale:  # before the wait: a node the autoscaler adds is one it was asked for
            request_job_resources(cfg, cfg.cluster.num_rollout_workers)
        wait_for_nodes(cfg, resource_wait_s)
        self.learner, self.pool = start_actors(cfg, self.progress.total_steps, self.counters, say)
        self.log.trackers = Trackers(cfg)
        return self.status()

    # --------------------------------------------------------------------------------- cycle

    @one_at_a_time
    def step(self) -> dict:
        """One generation cycle: collect unique_prompts fresh groups (or take the batch already training), train on
        them, publish the adapter, record the metrics (and evaluate, and save, when due). With max_staleness >= 1
        the next batch starts training as soon as this one is trained (services/orchestrator/pipeline.py)."""
        try:
            return self._cycle(ahead=True)
        except (self.pool.ray.exceptions.RayActorError, self.pool.ray.exceptions.OwnerDiedError) as e:
            # a learner rank lost (or an object it owned, the adapter it published): said by rank and node
            if line := self.learner.lost(e):
                raise LearnerLost(line) from e
            raise

    def _cycle(self, ahead: bool) -> dict:
        self._evaluate_on_start()
        stage, before = Stages(), self._rollout_stats()
        training, self.progress.training = self.progress.training, None
        if training is None:
            with stage("collect"):
                training = self._start_training(*self._collect())
        with stage("train"):
            result, training = self._finish_training(training)
        batch = training.batch
        self.progress.cycle += 1
        with stage("publish"):
            self.progress.version, adapter_ref = result["adapter"]
            saving = self.checkpoints.due([s["step"] for s in result["steps"]])
            ahead = ahead and trained_ahead_allowed(self.cfg.cluster.max_staleness, self._batches_left(), saving,
                                                    self.progress.interrupted.is_set())
            if ahead:
                self.progress.training = self._train_ahead()  # before the send: the learner waits for nothing
            sent = self.pool.send(self.version, adapter_ref), time.time()  # to every worker
            self._feed_ahead()
            started = self._await_published(sent, train_ahead=ahead)
        steps = self._metrics(result["steps"], batch, before, stage, training.sampled)
        with stage("record"):
            saved = self._record(steps, saving)
            self.log.push()
        self._autoscale(stage.seconds, self.plan.unique_prompts if started else 0)
        return {"version": self.version, "steps": steps, "done": self._done(), "notices": notices(), "saved": saved}

    def _batches_left(self) -> int:
        """The run's batches not yet trained (one in training included)."""
        return self.total_cycles - self.cycle

    def _done(self) -> bool:
        return self.cycle >= self.total_cycles

    def _autoscale(self, t: dict, started: int) -> None:
        """started: the groups of a batch that started training during the publish wait, counted as buffered: they
        were ready before the cycle ended (and would have waited in the buffer for the next cycle's collect)."""
        load = CycleLoad(wait_s=t["collect"], train_s=t["train"], buffered=len(self.buffer) + started,
                         batch=self.plan.unique_prompts, starting=len(self.pool.starting(0)))
        if line := autoscale(self.cfg, self.pool, load, self.counters):
            say(line)

    def _evaluate_on_start(self) -> None:
        if self.cycle == 0 and self.evaluator and self.cfg.eval.eval_on_start and not self.log.has_step(0):
            self.log.write([{"step": 0, **self.evaluator.run(self.pool.ray, self._serving(), self.version, 0)}])

    def _serving(self) -> list:
        """The workers serving now, once there is one: prompts are taken back and dead workers replaced meanwhile."""
        while not self.pool.serving():
            self._gather(0, timeout=1.0)
        return self.pool.serving()

    def _collect(self) -> tuple[list, dict]:
        """Until unique_prompts fresh groups are buffered: prompts handed out, groups taken back, stale ones
        handed out again, the batch filled at the oversampling bound. -> the batch, dynamic sampling's counts."""
        U, filled = self.plan.unique_prompts, 0
        while True:
            if self.progress.interrupted.is_set():  # before training: nothing of this cycle is trained or lost
                raise CycleInterrupted(f"cycle {self.cycle} interrupted while gathering groups")
            self.intake.drop_stale(self.version)
            if len(self.buffer) >= U:
                break
            if self.buffer.oversampled() and not self.pool.in_flight():
                filled = self.buffer.fill(U, self.version)
                self.counters["groups_filled"] += filled
                continue
            self._gather(max(U, self._wanted(training=False)), timeout=1.0)
        sampled = self._sampled(filled)
        return self.buffer.take(self.plan.unique_prompts), sampled  # the groups of the oldest versions first

    def _sampled(self, filled: int) -> dict:
        """Dynamic sampling's counts of the batch about to be taken (the take starts them again)."""
        return {"dynamic_sampling/prompts_sampled": self.buffer.sampled, "dynamic_sampling/filled": filled}

    def _start_training(self, batch: list, sampled: dict) -> Training:
        """The batch to the learner, whose result brings the adapter to publish (export=True). The batches after it
        train at version + 1 or later: a request sampled before version + 1 - max_staleness is stopped now, not when
        that version is published (its sequences would take the engine's steps for the whole training). The run's
        last batch stops every training request: nothing trains them in this run (services/orchestrator/pipeline.py:
        with k >= 1 up to one batch of prompts is out past the last)."""
        training = Training(batch, sampled, self.learner.train_async([g for _, g in batch], True))
        taken = time.time()  # run_log.sampling_times: how long each waited in the buffer (the first take's, if again)
        for m, _ in batch:
            m.setdefault("taken_at", taken)
        if (k := self.cfg.cluster.max_staleness) >= 1:  # after the learner's call: it waits for nothing of this
            if self._batches_left() == 1:
                self.progress.all_taken = True
                self.pool.stop_training()
                if left := self.pool.in_flight() + len(self.buffer):
                    say(f"tandem: the run's last batch is taken; the {left} prompt(s) out past it stop and stay in "
                        "the last checkpoint (a resume with more steps hands them out first)")
            else:
                self.pool.trainable_from(self.version + 1 - k)
        return training

    def _train_ahead(self) -> Training | None:
        """The next batch, when its groups are buffered fresh for the version just exported, starts training now.
        -> its Training, or None (the next cycle collects it)."""
        self.intake.drop_stale(self.version)
        if len(self.buffer) < self.plan.unique_prompts:
            return None
        sampled = self._sampled(filled=0)
        self.counters["batches_trained_ahead"] += 1
        return self._start_training(self.buffer.take(self.plan.unique_prompts), sampled)

    def _finish_training(self, training: Training) -> tuple[dict, Training]:
        """The learner's result of a batch; with max_staleness >= 1 the workers keep sampling meanwhile. Groups whose
        objects were lost with a node (the learner could not fetch them: nothing trained) are handed out again and
        the batch filled anew. -> (the learner's result, the training of the batch it trained on)."""
        while True:
            try:
                result = self._wait_trained(training.refs)
            except self.pool.ray.exceptions.RayError as e:
                if not lost_object(e):
                    raise
                self.intake.without_lost(training.batch, self.pool.ray, say)  # the rest back in the buffer's front
                training = self._start_training(self._collect()[0], training.sampled)
                continue
            self.counters["stale_masked_tokens"] += int(result["steps"][0].get("rollout/stale_masked_tokens", 0))
            for m, _ in training.batch:
                self.counters["trained_group_tokens"] += m.get("tokens", 0)
                self.record.add(m["epoch"], m["index"], m["version"])
                self.log.group("trained", self.version, m["index"], m["epoch"], m["version"], cycle=self.cycle + 1,
                               tokens=m.get("tokens"), taken_at=m.get("taken_at"))
            return result, training

    def _wait_trained(self, refs: list) -> dict:
        """The learner's result; with max_staleness >= 1 groups are taken back and prompts handed out meanwhile,
        and the training's end wakes the wait at once (the next batch may start training then)."""
        ray, busy_ok, waiting = self.pool.ray, self.cfg.cluster.max_staleness > 0, refs
        while True:
            if busy_ok:
                self._gather(self._wanted(training=True), timeout=0.05, wake=waiting)
            busy = busy_ok and self.pool.in_flight()
            done, waiting = ray.wait(refs, num_returns=len(refs), timeout=0.0 if busy else 0.5)
            ray.get(done)  # a dead rank raises now, not after the others time out at a collective
            if not waiting:
                return ray.get(refs)[0]

    def _wanted(self, training: bool) -> int:
        return prompts_wanted(self.plan.unique_prompts, self.cfg.cluster.max_staleness, training, self._batches_left(),
                              oversample_prompts(self.cfg))

    def _gather(self, want: int, timeout: float, wake: list = ()) -> int:
        """Keep `want` prompts buffered or in flight, take what came back within `timeout` (or until one of `wake`
        resolves). -> how many came back."""
        room = self.buffer.room(want, self.pool.in_flight())
        if room > 0:
            self.buffer.handed_out(self.pool.feed(lambda: self.source.next_item(self.version), room))
        results, lost = self.pool.poll(timeout=timeout, wake=wake)
        self.intake.lost(lost)
        for it, meta, ref in results:
            self.intake.accept(it, meta, ref, self.version, self.progress.all_taken)
        return len(results)

    # Publishing waits for no generation: each worker loads the adapter between two engine steps while its requests
    # run on, so every worker serves the new version before the next cycle begins (with max_staleness 0, before any
    # of its prompts goes out).
    def _feed_ahead(self) -> None:
        """The prompts the staleness bound allows for the version just sent go out now (those of the batches after the
        one in training, if any): each worker starts them the moment it serves that version, while this cycle's
        metrics, evaluation, checkpoint and the driver's next call run. With max_staleness 0 that is the next batch,
        sampled with the new version while the bookkeeping runs. Prompts held past the staleness bound
        at an older version go out first (PromptSource.next): sampled with this one, they have the most time the bound
        gives."""
        self._gather(self._wanted(training=self.progress.training is not None), timeout=0.0)

    def _await_published(self, sent: tuple, train_ahead: bool = False) -> bool:
        """Every worker serves the version sent; prompts a worker that died on it held are handed out again.
        train_ahead: meanwhile groups are taken back, and the next batch starts training the moment it is buffered.
        -> whether it started one."""
        handed, sent_at = sent
        waiting, started = [ref for _, ref in handed], False
        while train_ahead and self.progress.training is None and waiting:
            self._gather(self._wanted(training=False), timeout=0.05, wake=waiting)
            self.progress.training = self._train_ahead()
            started = self.progress.training is not None
            waiting = self.pool.ray.wait(waiting, num_returns=len(waiting), timeout=0)[1]
        self.intake.lost(self.pool.wait_published(handed))
        self.progress.publish_latency_s = time.time() - sent_at
        return started

    # ------------------------------------------------------------------------------ metrics

    def _rollout_stats(self) -> dict:
        return {"t": time.time(), "workers": {s["worker"]: s for s in self.pool.stats()},
                "dropped_tokens": self.counters["stale_dropped_tokens"]}

    def _metrics(self, steps, batch, before, stage: Stages, sampled: dict) -> list[dict]:
        t, metas = stage.seconds, [m for m, _ in batch]
        lines = cycle_lines(steps, metas, self.version, before, self._rollout_stats(), self.counters,
                            self.progress.last_take, {
            "cycle": self.cycle, "generate_wait_s": t["collect"], "train_s": t["train"], "publish_s": t["publish"],
            "publish_latency_s": self.progress.publish_latency_s, "cycle_s": time.time() - stage.t0,
            "queue_depth": len(self.buffer) + self.pool.in_flight(), "prompts_in_flight": self.pool.in_flight(),
            "cluster/rollout_workers": self.pool.target,
            "rollout/prompts_never_trained": self.intake.failures.never_trained(),
            **(sampled if self.cfg.grpo.dynamic_sampling else {})})
        self.progress.last_take = max((m["taken_at"] for m in metas if m.get("taken_at")), default=None)
        return lines

    def _record(self, steps: list[dict], saving: bool) -> str | None:
        """The eval when due (on the last step's line), the metrics lines, the checkpoint when `saving` (-> its
        path)."""
        if self.evaluator and self.evaluator.due(steps[0]["step"], steps[-1]["step"], self._done()):
            steps[-1].update(self.evaluator.at(self.pool, self._serving, self.version, steps[-1]["step"],
                                               self._done(), say))
        self.log.write(steps)
        return self._save() if saving else None

    # ------------------------------------------------------------------------------- control

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: the cycle in progress stops gathering (a cycle already training finishes its
        training first), so that a checkpoint is written within seconds, not after a slow generation."""
        self.progress.interrupted.set()

    def scale(self, n: int) -> dict:
        """Set the number of rollout workers of a live job (`tandem scale`); applied at the next feed."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Controller.scale: num_rollout_workers = {n!r}; allowed a whole number >= 1")
        self.pool.scale(n)
        return self.status()

    def status(self) -> dict:
        return {"cycle": self.cycle, "total_cycles": self.total_cycles, "version": self.version,
                "workers": len(self.pool.slots) if self.pool else 0,
                "serving": len(self.pool.serving()) if self.pool else 0,
                "target_workers": self.pool.target if self.pool else 0,
                "in_flight": self.pool.in_flight() if self.pool else 0,
                "buffered": len(self.buffer) if self.buffer else 0, "counters": dict(self.counters)}

    # --------------------------------------------------------------------------- checkpoints

    def state(self) -> dict:
        """The parts' states. Prompts in flight or buffered were not trained on: on resume they are handed out
        again (the source's state holds them)."""
        ahead = self.progress.training.batch if self.progress.training else []  # (a save drains it first)
        pending = [(it.index, it.epoch) for it in self.pool.pending_items()] + self.buffer.pending() + \
            [(m["index"], m["epoch"]) for m, _ in ahead]
        return {"fingerprint": self.checkpoints.fingerprint, "source": self.source.state(pending),
                "progress": self.progress.state(), "record": self.record.state(), "buffer": self.buffer.state(),
                "failures": self.intake.failures.state(), "counters": dict(self.counters)}

    @one_at_a_time
    def save_checkpoint(self) -> str:
        """A checkpoint of the run as it stands. A batch training ahead is finished as its cycle first (trained,
        published, recorded: the driver's stop takes effect after it), so that the weights saved are those the
        state says were trained."""
        if self.progress.training is not None:
            saved = self._cycle(ahead=False)["saved"]
            if saved:
                return saved
        return self._save()

    def _save(self) -> str:
        path = self.learner.save_checkpoint(self.checkpoints.path(self.cycle), {"controller": self.state()})
        self.checkpoints.prune()
        write_trl_checkpoint(path, self.cfg, self.log.lines(), self.progress.total_steps, self.epochs)
        self.log.push()
        return path

    @property
    def epochs(self) -> Epochs:
        return Epochs(self.plan.optimizer_steps_per_cycle, self.plan.unique_prompts, self.record.epochs.rows)

    @one_at_a_time
    def resume(self) -> str | None:
        """Continue from the newest checkpoint that loads; the metrics of steps after it are cut from metrics.jsonl.
        Each checkpoint skipped (newer than the one resumed from) is set aside as `<name>.refused`; it and a metrics
        line a crash cut are named in `resume_notes()`; when checkpoints exist and none loads, the run is refused.
        -> the path resumed from, or None when there is no checkpoint."""
        found = self.checkpoints.resume(self._load)
        if found is None:
            self.log.cut_back(0)  # steps a run that died before its first checkpoint logged are trained again
            return None
        path, meta = found
        self.log.cut_back(meta["steps"])
        return str(path)

    def resume_notes(self) -> list[str]:
        return self.checkpoints.skipped + self.log.cut

    def _load(self, ck: Path) -> dict:
        """One checkpoint into the learner and the parts (raises when it was written by another job)."""
        self.checkpoints.refuse_another_job(ck, self.cfg.checkpoint.allow_changed_job)
        meta = self.learner.load_checkpoint(str(ck))
        self._restore(meta["controller"])
        return meta

    def _restore(self, st: dict) -> None:
        st = parts_state(st, len(self.table))
        self.source.load(st["source"])
        self.progress.load(st["progress"])
        self.record.load(st["record"])
        self.buffer.load(st["buffer"])
        self.intake.failures.load(st["failures"])
        self.counters.clear()
        self.counters.update(st["counters"])
        if self.version > 0:
            self.progress.version, adapter_ref = self.learner.export_adapter()
            self._await_published((self.pool.send(self.version, adapter_ref), time.time()))

    @one_at_a_time
    def shutdown(self) -> None:
        """Stop the rollout workers and the learner."""
        if self.pool:
            self.pool.shutdown()
        if self.log.trackers is not None:
            self.log.trackers.close()
        self.log.flush_groups()  # groups that came back after the last step's line
        self.log.push()  # the trackers' last files
        if self.learner is not None:
            self.learner.shutdown()
        if self.cfg.cluster.autoscale:
            request_rollout_resources(0, {}, [])  # the job's request withdrawn: its nodes may go once idle


def parts_state(st: dict, rows: int) -> dict:
    """A checkpoint's controller state by part. Older checkpoints kept one flat dict (and before that, lists of
    the trained and filtered groups instead of EpochRecords)."""
    if "progress" in st:
        return st
    if "trained" in st:  # EpochRecords
        trained, filtered = st["trained"], EpochRecord(rows, "filtered")
        filtered.load(st["filtered"])
    else:  # lists of (epoch, index, version)
        trained = EpochRecord.from_pairs(rows, st["seen"]).state()
        filtered = EpochRecord.from_pairs(rows, st.get("filtered", []), "filtered")
    for e, i, _ in st.get("filler", []):
        filtered.add(e, i)
    return {"source": dict(st["cursor"], next_group_id=st["next_group_id"]),
            "progress": {"cycle": st["cycle"], "version": st["version"]}, "record": {"trained": trained},
            "buffer": {"filtered": filtered.state()}, "failures": {"failed": st["failed"]},
            "counters": st["counters"]}
