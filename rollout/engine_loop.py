"""The engine loop: the one thread that owns an engine and steps it. The rollout worker's call threads hand it
typed commands through one inbox and wait on what they handed in; nothing else touches the engine.

Commands:
  Sample(request, hold)  sample one prompt's completions (a request; an episode's next turn re-enters as one,
                         pinned to the version its episode started on); hold: that version stays loaded after the
                         request ends, until `hold` Releases (a group's first turn holds it once per episode, each
                         episode's end releases it)
  Release(v)             an episode on version v has ended
  LoadVersion(v, ...)    serve policy version v from now on (an adapter or full weights)
  TrainableFrom(v)       no training will take a group sampled before version v (the controller took the batch
                         that was the last one able to): training requests on older versions stop now
  StopTraining()         the run took its last batch: the training requests in the engine now, and those waiting
                         for a version, stop (RunEnded); one that comes later runs
  STOP                   end the loop

In flight (`inflight`, the default at max_staleness >= 1, on an engine that `updates_in_flight`): a training group's
request is live: each load reaches it between two engine steps, its sequences sample their next tokens with the new
version, and the loop records where each sequence stood at the load (`Engine.progress`), so every completion token
carries the version that sampled it (Completion.versions). A live request is never stopped for staleness (the learner
masks a token too old for the weights that train on it, learner/batch.py); a merged engine loads a new version
without draining its live requests. Otherwise (a group finishes under its own version, `cluster.inflight_updates:
false`):
A request can never become a trainable group once the newest version published (loaded, or waiting to load)
is more than max_staleness ahead of the one it samples with, or once the controller says so (TrainableFrom: it
took the last batch that could hold it, a training before that publish): an engine that can stop a request
mid-sampling (`Engine.can_abort`) stops it at the next turn and fails it with StaleRequest, so that its sequences stop taking
the engine's steps (a long completion at a small max_staleness would otherwise run to its end only to be dropped).
Only a training group's request is stopped (`Request.stoppable`); an evaluation's runs to its end, and so does one
an episode holds its version for, or a later turn pinned to one: the episode is one unit.

Queues, and the order they are taken in each turn (the rule lives in `_turn`):
  held     an engine that serves one version at a time (weights merged) does not load a new version while
           requests run or an episode holds a version: that command and every command after it wait here, and
           the engine drains first
  inbox    what the call threads sent since the last turn
  early    requests for a version not served yet (sent while that version is being published): kept until a
           load makes it served
  running  requests inside the engine, by key: each finishes on the version it started with

Each turn takes held, then the inbox, then early, in that order, so a load among new commands is applied before
the early requests it makes due; then one engine step. Loads happen only here, between two engine steps.
An engine that streams (`Engine.streams`: add / step) takes requests as they come; one that does not samples the
turn's requests in one `generate` call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tandem.rollout.engines.base import Engine, Sampling

# With the engine idle, the first command waits up to ARRIVAL_WINDOW_S for others arriving within ARRIVAL_GAP_S
# of each other: a burst of prompts (a cycle handed out at once) starts in one engine step. Stepping on the first
# prompt alone holds the GIL that Ray's call threads need to deliver the rest (bench/rollout.py).
ARRIVAL_WINDOW_S = 0.05
ARRIVAL_GAP_S = 0.005


class StaleRequest(Exception):
    """A request stopped mid-sampling: no training can take it any more (its version fell more than max_staleness
    behind the newest published, or before the oldest one the controller's next batches may take)."""

    def __init__(self, version: int, trainable_from: int, max_staleness: int):
        super().__init__(f"sampled with policy version {version}; the next trainings take groups of version "
                         f"{trainable_from} or newer (max_staleness {max_staleness}): stopped, to be sampled again")
        self.version = version


class RunEnded(StaleRequest):
    """A training request stopped because the run took its last batch (StopTraining): its prompt is left for a
    resume, not sampled again in this run."""

    def __init__(self, version: int):
        Exception.__init__(self, f"sampled with policy version {version}; the run took its last batch: stopped")
        self.version = version


class Request:
    """A prompt between its arrival and its completions: the calling thread waits on `done`."""

    __slots__ = ("ids", "sampling", "min_version", "pin", "version", "result", "error", "done", "submitted",
                 "started", "hold", "stoppable", "first_step", "live", "boundaries", "_callbacks")

    def __init__(self, ids: np.ndarray, sampling: Sampling, min_version: int = 0, pin: int | None = None,
                 stoppable: bool = False):
        """min_version: sampled with this version or a newer one; pin: with exactly this one (an episode's later
        turns, on the version its first turn held); stoppable: a training group's, which the loop stops once it can
        never be trained (an evaluation's runs to its end)."""
        self.ids, self.sampling, self.min_version, self.pin = ids, sampling, min_version, pin
        self.stoppable = stoppable
        self.version, self.result, self.error = 0, None, None  # version: the one it was sampled with
        self.done = threading.Event()
        self.submitted = 0.0
        self.started = False  # its version is chosen (set by the loop's thread)
        self.hold = 0  # the holds it took on its version (given back by the loop if it fails)
        self.first_step = 0  # the loop's engine-step count when it entered the engine (a streaming one)
        self.live = False  # follows every load while it runs (in flight)
        self.boundaries: list[tuple[int, dict]] = []  # (version loaded, {sequence: tokens it had sampled before})
        self._callbacks: list = []

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.finish()

    def finish(self) -> None:
        """Done (result or error set): wakes the thread waiting on `done` and the callbacks (an episode's
        coroutine waits so, rollout/episodes.py)."""
        self.done.set()
        for fn in list(self._callbacks):
            fn()

    def when_done(self, fn) -> None:
        """Call fn() from the engine loop's thread once done (at once, here, if it is). fn may run twice when it
        is added as the request finishes: it must be idempotent."""
        self._callbacks.append(fn)
        if self.done.is_set():
            fn()


@dataclass
class Sample:
    request: Request
    hold: int = 0  # keep the version it starts on loaded after it ends, until this many Release (its episodes)


@dataclass
class Release:
    version: int


@dataclass
class TrainableFrom:
    version: int


@dataclass
class StopTraining:
    pass


@dataclass
class LoadVersion:
    version: int
    tensors: dict
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


STOP = None  # the command that ends the loop


def stoppable(req: Request, hold: int) -> bool:
    """A training group's request that the loop may stop: not an evaluation's, nor an episode's (one that holds its
    version for its episodes, or a later turn pinned to it: the episode is one unit)."""
    return req.stoppable and hold == 0 and req.pin is None


class EngineLoop:
    """`submit(command)` from any thread; `run(engine)` in the thread that built the engine (vLLM keeps a CUDA
    stream per thread) until STOP or `stop()`. version: the newest version served (0: the base model)."""

    def __init__(self, lora: bool, max_staleness: int | None = None, inflight: bool = False):
        """max_staleness: stop requests that can never be trained (None: every request runs to its end);
        inflight: a training request follows every load (where the engine can)."""
        self.lora = lora  # versions are adapters (else full weights)
        self.max_staleness = max_staleness
        self.inflight = inflight
        self.version = 0
        self.trainable_from = 0  # the oldest version a training may still take (TrainableFrom)
        self.engine: Engine | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._held: list = []
        self._early: list[Sample] = []
        self._running: dict[int, Request] = {}
        self._in_use: Counter = Counter()  # version -> requests running on it
        self._holds: Counter = Counter()  # version -> episodes between two turns on it
        self._next_key = 0
        self._steps = 0  # the streaming engine's steps so far
        self._times_lock = threading.Lock()
        # stale_sequence_steps: the engine steps that requests stopped past max_staleness ran, times their
        # sequences: at most the tokens sampled for nothing (a sequence that ended early took fewer)
        self.times = {"generate_s": 0.0, "busy_s": 0.0, "stale_sequence_steps": 0}

    def submit(self, command) -> None:
        self._inbox.put(command)

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(STOP)

    def timings(self) -> dict:
        """Seconds (generate_s, busy_s), the streaming engine's steps so far, and stale_sequence_steps."""
        with self._times_lock:
            return dict(self.times, engine_steps=self._steps)

    def run(self, engine: Engine) -> None:
        self.engine = engine
        while not self._stop.is_set():
            self._turn()

    # ------------------------------------------------------------------------------ one turn

    def _turn(self) -> None:
        due = any(s.request.min_version <= self.version for s in self._early)  # its version loaded meanwhile
        # nothing to do until a command comes: nothing runs, nothing is due, and what is held (if anything) waits
        # for an episode's next turn or its release, which come through the inbox
        idle = not (self._running or due or (self._held and not +self._holds))
        commands, self._held = self._held + (self._arrivals() if idle else []), []
        commands += self._drain_inbox()
        commands, self._early = commands + self._early, []
        batch: list[Sample] = []
        stop_training = False
        for cmd in commands:
            if cmd is STOP:
                self._stop.set()  # this turn ends what it has begun; no next turn
            elif isinstance(cmd, TrainableFrom):  # loads nothing: never waits behind a held load
                self.trainable_from = max(self.trainable_from, cmd.version)
            elif isinstance(cmd, StopTraining):  # applied after this turn's arrivals, which it stops too
                stop_training = True
            elif self._held and not continues_episode(cmd):
                self._held.append(cmd)  # behind a load that waits: the order is kept
            elif isinstance(cmd, Release):
                self._holds[cmd.version] -= 1
            elif isinstance(cmd, LoadVersion):
                if self._must_drain():
                    self._held.append(cmd)  # drain first: the load and what follows it wait (an episode's turns pass)
                else:
                    self._load(cmd)
            elif cmd.request.pin is None and cmd.request.min_version > self.version:
                self._early.append(cmd)
            elif self.engine.streams:
                self._add(cmd)
            else:
                batch.append(cmd)
        if stop_training:
            self._stop_training()
        self._stop_stale()
        self._step(batch)

    def _must_drain(self) -> bool:
        """A load waits for the engine to drain: it serves one version at a time and a request (or an episode's hold)
        stays on the one it has; live requests ride across."""
        return self.engine.serves_one_version and (any(not r.live for r in self._running.values()) or +self._holds)

    def _stop_training(self) -> None:
        """StopTraining on an engine that can stop a request (a streaming one: what arrived this turn is running
        already): every training request running stops, and one waiting for its version fails before it starts."""
        if not self.engine.can_abort:
            return
        for key, req in list(self._running.items()):
            if stoppable(req, req.hold):
                self._abort(key, RunEnded(req.version))
        waiting, self._early = self._early, []
        for s in waiting:
            if stoppable(s.request, s.hold):
                s.request.fail(RunEnded(s.request.min_version))
            else:
                self._early.append(s)

    def _stop_stale(self) -> None:
        """Requests that can never be trained (the module's docstring) stopped and failed with StaleRequest."""
        if self.max_staleness is None or not self.engine.can_abort or not self._running:
            return
        newest = max([self.version] + [c.version for c in self._held if isinstance(c, LoadVersion)])
        oldest = max(newest - self.max_staleness, self.trainable_from)
        for key, req in list(self._running.items()):
            if stoppable(req, req.hold) and not req.live and req.version < oldest:
                self._abort(key, StaleRequest(req.version, oldest, self.max_staleness))

    def _abort(self, key: int, error: StaleRequest) -> None:
        """A running request stopped in the engine and failed with `error`."""
        req = self._running.pop(key)
        self.engine.abort(key)
        self._in_use[req.version] -= 1
        if not isinstance(error, RunEnded):  # the run's end stops what no training would take anyway
            with self._times_lock:
                self.times["stale_sequence_steps"] += (self._steps - req.first_step) * req.sampling.n
        req.fail(error)

    def _drain_inbox(self) -> list:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _arrivals(self) -> list:
        """With the engine idle: the first command, then whatever follows it closely."""
        cmds = [self._inbox.get()]
        end = time.monotonic() + ARRIVAL_WINDOW_S
        while isinstance(cmds[-1], Sample) and (left := end - time.monotonic()) > 0:
            try:
                cmds.append(self._inbox.get(timeout=min(left, ARRIVAL_GAP_S)))
            except queue.Empty:
                break
        return cmds

    def _adapter(self, version: int) -> int | None:
        return version if (version > 0 and self.lora) else None

    def _start_version(self, cmd: Sample) -> int:
        """The version a request starts on: its pin, else the newest; a hold keeps it loaded past the request."""
        v = self.version if cmd.request.pin is None else cmd.request.pin
        self._holds[v] += cmd.hold
        cmd.request.hold, cmd.request.version, cmd.request.started = cmd.hold, v, True
        return v

    def _add(self, cmd: Sample) -> None:
        req = cmd.request
        req.version, req.submitted = self._start_version(cmd), time.time()
        req.live = self.inflight and self.engine.updates_in_flight and stoppable(req, cmd.hold)
        try:
            if req.live:
                self.engine.add(self._next_key, req.ids, req.sampling, live=True)
            else:
                self.engine.add(self._next_key, req.ids, req.sampling, adapter=self._adapter(req.version))
        except Exception as e:  # noqa: BLE001 - refused by the engine (bad sampling, too long): its caller
            self._give_back(req)  # hears it; the loop and every other request go on
            req.fail(e)
            return
        self._in_use[req.version] += 1
        req.first_step = self._steps
        self._running[self._next_key] = req
        self._next_key += 1

    def _give_back(self, req: Request) -> None:
        """A failed request's holds: its episodes will not run (their callers release nothing)."""
        self._holds[req.version] -= req.hold
        req.hold = 0

    def _step(self, batch: list[Sample]) -> None:
        if not (batch or self._running):
            return
        t0 = time.time()
        try:
            if batch:
                self._generate(batch)
            else:
                self._steps += 1
                for key, comps in self.engine.step():
                    self._finish(self._running.pop(key), comps)
        except BaseException as e:  # noqa: BLE001 - the engine broke: every waiting call hears it
            for req in list(self._running.values()) + [c.request for c in batch]:
                self._give_back(req)
                req.fail(e)
            self._forget_running()
            self._in_use.clear()
        with self._times_lock:
            self.times["busy_s"] += time.time() - t0

    def _forget_running(self) -> None:
        """After a failed step, the engine drops what it still held of the failed requests: their outputs would
        otherwise come back in a later step under keys no request has any more, and fail every request after them."""
        if self.engine.can_abort:
            for key in self._running:
                try:
                    self.engine.abort(key)
                except Exception:  # noqa: BLE001,S110 - an engine that broke may refuse this too; its requests failed
                    pass
        self._running.clear()

    def _finish(self, req: Request, comps) -> None:
        self._in_use[req.version] -= 1
        if req.boundaries:
            for g, c in enumerate(comps):
                c.versions = token_versions(req.version, req.boundaries, g, len(c.tokens))
        req.result = comps
        with self._times_lock:
            self.times["generate_s"] += time.time() - req.submitted
        req.finish()

    def _generate(self, cmds: list[Sample]) -> None:
        by: dict[tuple, list[Request]] = {}
        for c in cmds:
            by.setdefault((c.request.sampling, self._start_version(c)), []).append(c.request)
        for (sampling, version), group in by.items():
            t0 = time.time()
            outs = self.engine.generate([r.ids for r in group], sampling, adapter=self._adapter(version))
            for r, comps in zip(group, outs):
                r.version, r.submitted, r.result = version, t0, comps
                r.finish()
            with self._times_lock:
                self.times["generate_s"] += time.time() - t0

    def _load(self, cmd: LoadVersion) -> None:
        try:
            if cmd.version > self.version:
                live = {key: r for key, r in self._running.items() if r.live}
                where = {key: self.engine.progress(key) for key in live}  # the tokens sampled before the load
                if self.lora:
                    self.engine.load_adapter(cmd.version, cmd.tensors)
                    # versions nobody samples with any more leave the engine (the newest stays)
                    self.engine.drop_adapters([v for v in self.engine.adapter_versions
                                               if v < cmd.version and not self._in_use[v] and self._holds[v] <= 0])
                else:
                    self.engine.load_weights(cmd.version, cmd.tensors)
                self.version = cmd.version
                for key, r in live.items():
                    r.boundaries.append((cmd.version, where[key]))
        except BaseException as e:  # noqa: BLE001 - handed to the caller that sent the load
            cmd.error = e
        finally:
            cmd.done.set()


def token_versions(start: int, boundaries: list[tuple[int, dict]], seq: int, length: int) -> np.ndarray:
    """int32 [length]: the version that sampled each token of sequence `seq` of a live request that started on
    `start` and rode across `boundaries` ((version loaded, {sequence: tokens sampled before it}); a sequence absent
    from a boundary had finished before it)."""
    out = np.full(length, start, dtype=np.int32)
    for version, before in boundaries:
        if seq in before:
            out[before[seq]:] = version
    return out


def continues_episode(cmd) -> bool:
    """An episode's next turn or its end: it passes a load that waits for the engine to drain (the load waits for
    it, so holding it back behind the load would never end)."""
    return isinstance(cmd, Release) or (isinstance(cmd, Sample) and cmd.request.pin is not None)
