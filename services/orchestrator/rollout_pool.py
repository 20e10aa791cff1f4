"""The rollout workers of a job: keeps each fed up to its prompts in flight, streams back each group the
moment it is scored, publishes adapters, scales, and replaces dead workers.

One prompt is one `rollout` call (num_returns=2: metadata, group): the controller owns the returned
objects, so a group already back survives its worker's death, and a worker's death loses only the
prompts it held, which come back as `lost` for the caller to re-queue or fail. A prompt lost with a worker is a
suspect (it may be what killed it: a tool that exits its process): handed out again, it runs alone on a worker, so
that a second death names it and spares the prompts beside it. A worker replaced `max_worker_restarts` times in a
row without a group coming back stops the job. Knows nothing of the controller: it is handed prompts, a counter to
count events in and a function to say a line with."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from tandem.core.actor_names import death_cause

WAIT_NOTE_S = 10.0  # how often a worker that does not serve yet is said (the README promises a line every 10 s)
# A replacement that dies before it served, this soon after its predecessor went with its node, went with the same
# node: Ray placed it there in the seconds before the node was marked dead (seen in bench/chaos.py's runs). It is
# started again without counting a second failure: one lost node is one failure.
SAME_LOSS_S = 60.0
NODE_LOSS = ("its node died", "unreachable: its node or process does not answer")


@dataclass
class Slot:
    actor: object
    ready: object  # ref of setup (+ adapter) until the worker serves; None once it does
    in_flight: dict = field(default_factory=dict)  # meta ref -> (item, group ref)
    handed: int = 0  # prompts handed out so far (dispatch ties go to the least used)
    alone: bool = False  # runs a suspect: no other prompt until it comes back
    since: float = field(default_factory=time.time)  # when this worker was asked for
    placed: object = None  # ref of where it runs, resolved once a node holds it (its engine may still be starting)
    deaths: int = 0  # workers of this slot that died since a group last came back from it
    node_lost_at: float | None = None  # when this slot's last worker went with its node (SAME_LOSS_S)


def node_of(_worker) -> str:
    """In a worker's process: the node it runs on, as a line names it (host, address, Ray node id)."""
    import socket

    import ray

    from tandem.core.actor_names import node_line

    return node_line(socket.gethostname(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())


class RolloutPool:
    def __init__(self, start_worker, per_worker: int, counters: Counter, *, max_worker_restarts: int = 8,
                 say=print, request: str = "its resources"):
        """start_worker(slot) -> (actor, ref that resolves once it serves); per_worker: prompts in flight; request:
        what a worker asks Ray for, in words (said while a replacement waits for it)."""
        import ray

        self.ray = ray
        self._start, self.per_worker, self.counters = start_worker, per_worker, counters
        self.max_worker_restarts, self.say, self.request = max_worker_restarts, say, request
        self._noted = 0.0  # when a wait for a worker was last said
        self.suspects: set[tuple[int, int]] = set()  # (dataset index, epoch) of prompts lost with a worker
        self.parked: list = []  # suspects taken from the queue, waiting for an idle worker
        self.slots: list[Slot] = []
        self.target = 0
        self.version, self.adapter_ref = 0, None

    # --------------------------------------------------------------------------------- workers

    def start(self, n: int) -> None:
        """n workers, waited for (a job does not start without its rollout side)."""
        self.target = n
        for i in range(n):
            self.slots.append(Slot(*self._start(i)))
        self.ray.get([s.ready for s in self.slots])
        for s in self.slots:
            s.ready = None

    @property
    def workers(self) -> list:
        return [s.actor for s in self.slots]

    def serving(self) -> list:
        """The workers that serve the current version (not those still starting)."""
        return [s.actor for s in self.slots if s.ready is None]

    def _new(self, i: int) -> Slot:
        actor, ready = self._start(i)
        if self.adapter_ref is not None:  # after setup inside the actor: set_adapter waits for it
            ready = actor.set_adapter.remote(self.version, self.adapter_ref)
        return Slot(actor, ready, placed=actor.__ray_call__.remote(node_of))  # a threaded actor: answered beside setup

    def scale(self, n: int) -> None:
        """Applied at the next feed: new workers start with the current adapter and get prompts once they
        serve; surplus ones (the last slots) get no new prompts and stop once theirs have come back."""
        self.target = n

    def apply_scale(self) -> None:
        while len(self.slots) < self.target:
            self.slots.append(self._new(len(self.slots)))
            self.counters["workers_added"] += 1
        while len(self.slots) > self.target and not self.slots[-1].in_flight:
            self._stop(self.slots.pop())
            self.counters["workers_removed"] += 1
        self._mark_ready()

    def _mark_ready(self) -> None:
        """Workers that finished starting (and loading the adapter of their start) serve from now on."""
        for i, s in enumerate(self.slots):
            if s.ready is not None and self.ray.wait([s.ready], timeout=0)[0]:
                try:
                    self.ray.get(s.ready)
                    s.ready = None
                except self.ray.exceptions.RayError as e:
                    if lost_object(e):  # the adapter it was to load is gone with the learner that made it: the
                        raise  # learner's death, which restarts the job, not this worker's
                    self._replace(i, e)

    def _stop(self, s: Slot) -> None:
        if s.ready is None:  # one still starting has no engine to close
            try:
                self.ray.get(s.actor.shutdown.remote(), timeout=30)  # engines first: no shared memory leaks
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to stop
                pass
        self.ray.kill(s.actor)

    def _replace(self, i: int, cause: BaseException) -> list:
        """A dead worker's slot gets a new worker, not waited for (it serves once started), said in one line and
        counted as a worker failure (not again for a replacement that went with the same lost node: SAME_LOSS_S);
        -> the items it held (suspects from now on). RuntimeError past max_worker_restarts deaths in a row."""
        old = self.slots[i]
        try:
            self.ray.kill(old.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
        lost = [item for item, _ in old.in_flight.values()]
        self.suspects.update((it.index, it.epoch) for it in lost)
        running = f"dataset rows {sorted(it.index for it in lost)}" if lost else "no prompt"
        same_loss = (old.ready is not None and old.node_lost_at is not None
                     and time.time() - old.node_lost_at < SAME_LOSS_S)
        deaths = old.deaths + (not same_loss)
        self.counters["worker_failures"] += not same_loss
        # Ray's death of the actor in a few words; any other error (a test's, a lost object's) as its first line
        why = death_cause(cause) if isinstance(cause, self.ray.exceptions.RayActorError) else first_line(cause)
        what = f"rollout worker {i} died ({why}) while running {running}"
        if deaths > self.max_worker_restarts:
            raise RuntimeError(f"{what}: its {deaths}th death without a group coming back in between "
                               f"(cluster.max_worker_restarts = {self.max_worker_restarts}); the job stops")
        self.say(f"tandem: rollout worker {i}'s replacement went with the same lost node (placed there before Ray "
                 f"marked it dead); started again" if same_loss else f"tandem: {what}; replaced ({deaths} in a row)")
        new = self._new(i)
        new.handed, new.deaths = old.handed, deaths
        new.node_lost_at = old.node_lost_at if same_loss else (time.time() if why in NODE_LOSS else None)
        self.slots[i] = new  # serves once started (_mark_ready): the others go on meanwhile, not waiting for it
        return lost

    def _note_waits(self) -> None:
        """Every WAIT_NOTE_S while a worker has not served for that long: one line saying what it waits for."""
        every = WAIT_NOTE_S
        late = self.starting(every)
        if late and time.time() - self._noted >= every:
            self._noted = time.time()
            waited = time.time() - min(self.slots[i].since for i in late)
            serving = len(self.serving())
            self.say(f"tandem: rollout worker(s) {late} not serving after {waited:.0f} s: {self._waits_for(late)}; " +
                     (f"the job goes on with {serving} worker(s)" if serving else "the job waits for one"))

    def _waits_for(self, late: list[int]) -> str:
        """Why the late workers do not serve: their engine starting on the node that holds them, or no live node with
        the resources they ask for."""
        placed = [(i, self.slots[i].placed) for i in late if self.slots[i].placed is not None]
        done = set(self.ray.wait([r for _, r in placed], num_returns=len(placed), timeout=0)[0]) if placed else set()
        on = {}
        for i, r in placed:
            if r in done:
                try:
                    on[i] = self.ray.get(r, timeout=5)
                except self.ray.exceptions.RayError:
                    pass
        parts = [f"worker {i} starting its engine on node {node}" for i, node in sorted(on.items())]
        if waiting := [i for i in late if i not in on]:
            parts.append(f"worker(s) {waiting} waiting for {self.request} on a live node (`ray status` lists the "
                         "demand)")
        return "; ".join(parts)

    def starting(self, longer_than: float) -> list[int]:
        """The slots whose worker was asked for more than `longer_than` s ago and does not serve yet (a lost node's
        replacement waiting for resources no live node has free)."""
        now = time.time()
        return [i for i, s in enumerate(self.slots) if s.ready is not None and now - s.since > longer_than]

    def shutdown(self) -> None:
        for s in self.slots:
            self._stop(s)
        self.slots = []

    # ------------------------------------------------------------------------------ prompts

    def in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self.slots) + len(self.parked)

    def pending_items(self) -> list:
        return [item for s in self.slots for item, _ in s.in_flight.values()] + list(self.parked)

    def feed(self, next_item, room: int) -> int:
        """Hand out up to `room` prompts (next_item() gives each), least-loaded serving worker first,
        none beyond a worker's prompts in flight. -> how many went out."""
        self.apply_scale()
        live = [s for s in self.slots[:self.target] if s.ready is None]
        sent = 0
        while sent < room and (shared := [s for s in live if not s.alone]):
            s = min(shared, key=lambda x: (len(x.in_flight), x.handed))
            if len(s.in_flight) >= self.per_worker:
                break
            item = self.parked.pop(0) if self.parked else next_item()
            if (item.index, item.epoch) in self.suspects:  # alone, on a worker with nothing else in flight
                if s.in_flight:
                    self.parked.insert(0, item)
                    break
                s.alone = True
            item.queued_at, item.min_version = time.time(), self.version
            meta, group = s.actor.rollout.options(num_returns=2).remote(item)
            s.in_flight[meta] = (item, group)
            s.handed += 1
            sent += 1
        return sent

    def poll(self, timeout: float | None, wake: list = ()) -> tuple[list, list]:
        """Groups that came back within `timeout` (at least one unless it ran out, or one of `wake` resolved
        first: the caller's other work, a training, is noticed the moment it ends):
        -> ([(item, meta, group ref)], [items lost with a dead worker])."""
        self._note_waits()
        refs = [r for s in self.slots for r in s.in_flight]
        if not refs:
            starting = [s.ready for s in self.slots if s.ready is not None] + list(wake)
            if starting and timeout:  # nothing to take back: wait for a worker to serve instead of spinning
                self.ray.wait(starting, num_returns=1, timeout=timeout)
            self._mark_ready()
            return [], []
        done, _ = self.ray.wait(refs + list(wake), num_returns=1, timeout=timeout)
        more, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)  # and whatever else is ready
        done = set(done) | set(more)
        out, lost = [], []
        for i in range(len(self.slots)):
            s = self.slots[i]
            for ref in [r for r in s.in_flight if r in done]:
                item, group = s.in_flight.pop(ref)
                try:
                    meta = self.ray.get(ref)
                except self.ray.exceptions.RayTaskError as e:  # the call raised, the worker lives: that prompt's
                    # failure (retried once, then recorded), not the worker's; replacing the worker would hand the
                    # prompt out again to fail again, for ever
                    meta = {"failure": f"rollout of dataset row {item.index} raised {first_line(e)}", "no_reward": False}
                except self.ray.exceptions.RayError as e:  # worker died (or its result was lost)
                    s.in_flight[ref] = (item, group)  # among what it held when it died
                    lost += self._replace(i, e)
                    break
                s.deaths, s.alone = 0, s.alone and bool(s.in_flight)
                self.suspects.discard((item.index, item.epoch))
                out.append((item, meta, group))
        return out, lost

    def trainable_from(self, version: int) -> None:
        """Every serving worker told that no training will take a group sampled before `version` (not waited for:
        a worker that misses it stops those requests at the next publish instead)."""
        for actor in self.serving():
            actor.trainable_from.remote(version)

    def stop_training(self) -> None:
        """Every serving worker told that the run took its last batch: its training requests stop (not waited for: a
        worker that misses it runs them to their end, and their groups stay pending)."""
        for actor in self.serving():
            actor.stop_training.remote()

    # ----------------------------------------------------------------------------- publishing

    def send(self, version: int, adapter_ref) -> list:
        """Publishing, first half: the new version to every worker, not waited for (each loads it between
        two engine steps: no generation is waited for; a worker still starting gets it after its setup).
        Prompts fed from now on ask for it (PromptItem.min_version): a worker starts them once it serves it.
        -> what wait_published waits for."""
        self._mark_ready()  # a worker done starting is waited for like the others, not given a new start
        self.version, self.adapter_ref = version, adapter_ref
        serving = []
        for s in self.slots:
            ref = s.actor.set_adapter.remote(version, adapter_ref)
            if s.ready is None:
                serving.append((s, ref))
            else:
                s.ready = ref  # set_adapter waits for setup inside the actor: it serves once both are done
        return serving

    def wait_published(self, serving: list) -> list:
        """Publishing, second half: until every worker `send` reached serves the version. A worker that died
        is replaced (the new one starts with this version); -> the prompts it held, to hand out again. One
        scaled away in between (a feed applies `scale`) is not waited for: it held no prompts."""
        lost = []
        for s, ref in serving:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                i = next((i for i, x in enumerate(self.slots) if x is s), None)
                if i is not None:
                    lost += self._replace(i, e)
        return lost

    def stats(self) -> list[dict]:
        refs = [s.actor.stats.remote() for s in self.slots if s.ready is None]
        out = []
        for r in refs:
            try:
                out.append(self.ray.get(r, timeout=30))
            except Exception:  # noqa: BLE001 - a worker dying now is handled by poll
                pass
        return out


def lost_object(e: BaseException) -> bool:
    """Whether a Ray error is (or was caused by) an object lost with its node or its owner."""
    import ray

    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)):
            return True
        e, seen = getattr(e, "cause", None) or e.__cause__, seen + 1
    return False


def first_line(e: BaseException) -> str:
    """The worker's own error of a RayTaskError, in one line (`Type: message`)."""
    cause = getattr(e, "cause", None) or e
    lines = [x for x in str(cause).strip().splitlines() if x.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"
