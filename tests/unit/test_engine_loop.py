"""The engine loop's promises, with a scripted engine in place of vLLM (no Ray, no model): a request finishes
on the version it started with, versions load between engine steps, an engine serving one version drains
before a new one, a request for a version not served yet is held until it is, a refused request fails alone."""

import threading

import numpy as np
import pytest

from tandem.rollout.engine_loop import STOP, EngineLoop, LoadVersion, Request, Sample
from tandem.rollout.engines.base import Completion, Engine, Sampling

SAMPLING = Sampling(n=1, max_tokens=4)


class ScriptedEngine(Engine):
    """A streaming engine whose requests each take `steps` engine steps; it records every event in order."""

    streams = True

    def __init__(self, steps: int = 3, serves_one_version: bool = False):
        self.steps, self.serves_one_version = steps, serves_one_version
        self.events: list[tuple] = []
        self.left: dict[int, int] = {}
        self.loaded: list[int] = []

    def add(self, key, ids, sampling, adapter=None):
        if len(ids) == 0:
            raise ValueError("empty prompt")
        self.left[key] = self.steps
        self.events.append(("add", key, adapter))

    def step(self):
        self.events.append(("step",))
        done = []
        for key in list(self.left):
            self.left[key] -= 1
            if self.left[key] == 0:
                del self.left[key]
                done.append((key, [Completion(np.array([key], np.int32), np.zeros(1, np.float32), True)]))
        return done

    def load_adapter(self, version, tensors):
        self.events.append(("load", version))
        self.loaded.append(version)

    @property
    def adapter_versions(self):
        return list(self.loaded)

    def drop_adapters(self, versions):
        self.loaded = [v for v in self.loaded if v not in versions]


class BatchEngine(Engine):
    """A non-streaming engine (transformers' generate): one call per turn."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, adapter=None):
        self.calls.append((len(prompts), adapter))
        return [[Completion(np.array([1], np.int32), np.zeros(1, np.float32), True)] for _ in prompts]


def started(engine, lora=True):
    loop = EngineLoop(lora=lora)
    t = threading.Thread(target=loop.run, args=(engine,), daemon=True)
    t.start()
    return loop, t


def request(min_version=0, ids=(1, 2)):
    return Request(np.array(ids, np.int32), SAMPLING, min_version)


def load(loop, version):
    cmd = LoadVersion(version, {})
    loop.submit(cmd)
    assert cmd.done.wait(5)
    return cmd


def finish(*reqs):
    for r in reqs:
        assert r.done.wait(5), "the request never finished"


def test_a_request_finishes_on_the_version_it_started_with_and_loads_come_between_steps():
    eng = ScriptedEngine(steps=50)
    loop, t = started(eng)
    a = request()
    loop.submit(Sample(a))
    while not any(e[0] == "step" for e in eng.events):
        pass
    load(loop, 1)  # while `a` runs
    b = request()
    loop.submit(Sample(b))
    finish(a, b)
    loop.stop()
    t.join(5)
    assert (a.version, b.version) == (0, 1) and loop.version == 1
    adds = {e[1]: e[2] for e in eng.events if e[0] == "add"}
    assert adds == {0: None, 1: 1}  # b sampled with adapter 1, a without (the base model)
    i = eng.events.index(("load", 1))
    assert eng.events[i - 1] == ("step",) and eng.events[i + 1] != ("load", 1)  # between two steps
    assert eng.events.index(("add", 0, None)) < i < eng.events.index(("add", 1, 1))


def test_an_engine_serving_one_version_drains_before_the_new_one_and_keeps_the_order_after_it():
    eng = ScriptedEngine(steps=5, serves_one_version=True)
    loop, t = started(eng)
    a = request()
    loop.submit(Sample(a))
    while not any(e[0] == "step" for e in eng.events):
        pass
    cmd = LoadVersion(1, {})
    b = request()
    loop.submit(cmd)
    loop.submit(Sample(b))  # after the load: must not start before it
    finish(a, b)
    assert cmd.done.is_set() and cmd.error is None
    loop.stop()
    t.join(5)
    i = eng.events.index(("load", 1))
    assert not any(e[0] == "add" and e[1] == 0 for e in eng.events[i:])  # a was done before the load
    assert eng.left == {} and a.version == 0 and b.version == 1
    assert eng.events.index(("add", 1, 1)) > i


def test_a_request_for_a_version_not_served_yet_is_held_until_it_is():
    eng = ScriptedEngine(steps=1)
    loop, t = started(eng)
    early = request(min_version=2)
    loop.submit(Sample(early))
    load(loop, 1)
    assert not early.done.wait(0.2) and not any(e[0] == "add" for e in eng.events)  # v1 is not enough
    load(loop, 2)
    finish(early)
    loop.stop()
    t.join(5)
    assert early.version == 2 and ("add", 0, 2) in eng.events


def test_a_refused_request_fails_alone_and_versions_no_request_uses_leave_the_engine():
    eng = ScriptedEngine(steps=2)
    loop, t = started(eng)
    bad, good = request(ids=()), request()
    loop.submit(Sample(bad))
    loop.submit(Sample(good))
    finish(bad, good)
    assert isinstance(bad.error, ValueError) and good.error is None and good.result is not None
    load(loop, 1)
    load(loop, 2)
    loop.submit(STOP)
    t.join(5)
    assert not t.is_alive(), "STOP did not end the loop"
    assert eng.loaded == [2]  # 1 left the engine: nothing ran on it


def test_a_non_streaming_engine_samples_a_turns_requests_in_one_call():
    eng = BatchEngine()
    loop = EngineLoop(lora=True)
    reqs = [request() for _ in range(3)]
    for r in reqs:
        loop.submit(Sample(r))
    t = threading.Thread(target=loop.run, args=(eng,), daemon=True)
    t.start()
    finish(*reqs)
    loop.stop()
    t.join(5)
    assert eng.calls == [(3, None)] and all(r.version == 0 for r in reqs)


def test_a_load_that_fails_is_handed_to_its_sender_and_the_version_stays():
    class Broken(ScriptedEngine):
        def load_adapter(self, version, tensors):
            raise RuntimeError("bad adapter")

    loop, t = started(Broken())
    cmd = load(loop, 1)
    loop.stop()
    t.join(5)
    assert isinstance(cmd.error, RuntimeError) and loop.version == 0
    with pytest.raises(RuntimeError, match="bad adapter"):
        raise cmd.error


def test_an_episode_keeps_its_version_across_turns_and_holds_it_loaded_until_released():
    """Turn 1 holds the version it starts on (v1); while its tool runs, v2 and v3 load; turn 2, pinned to v1, runs on
    v1 and v1 stays in the engine until the episode releases it (unused versions leave as before)."""
    from tandem.rollout.engine_loop import Release

    eng = ScriptedEngine(steps=1)
    loop, t = started(eng)
    load(loop, 1)
    turn1 = request()
    loop.submit(Sample(turn1, hold=True))
    finish(turn1)
    load(loop, 2)
    load(loop, 3)
    assert 1 in eng.loaded and 2 not in eng.loaded  # held, where an unused older version left
    turn2 = Request(np.array([1, 2], np.int32), SAMPLING, min_version=0, pin=turn1.version)
    loop.submit(Sample(turn2))
    finish(turn2)
    loop.submit(Release(turn1.version))
    load(loop, 4)
    loop.stop()
    t.join(5)
    assert (turn1.version, turn2.version) == (1, 1) and ("add", 1, 1) in eng.events
    assert 1 not in eng.loaded  # released: it leaves at the next load


def test_an_engine_serving_one_version_waits_for_held_episodes_before_a_new_one():
    from tandem.rollout.engine_loop import Release

    eng = ScriptedEngine(steps=1, serves_one_version=True)
    loop, t = started(eng)
    turn1 = request()
    loop.submit(Sample(turn1, hold=True))
    finish(turn1)
    cmd = LoadVersion(1, {})
    loop.submit(cmd)
    assert not cmd.done.wait(0.3)  # the episode on version 0 has not ended
    turn2 = Request(np.array([1, 2], np.int32), SAMPLING, pin=0)
    loop.submit(Sample(turn2))
    finish(turn2)
    loop.submit(Release(0))
    assert cmd.done.wait(5) and loop.version == 1
    loop.stop()
    t.join(5)
    assert turn2.version == 0 and eng.events.index(("add", 1, None)) < eng.events.index(("load", 1))


class AbortingEngine(ScriptedEngine):
    can_abort = True

    def abort(self, key):
        self.events.append(("abort", key))
        del self.left[key]


def training_and_evaluation_running(one_version: bool):
    """A loop at max_staleness 1 on an engine that can abort, a training group's request and an evaluation's running
    on v0, their sequences never ending by themselves. -> (engine, loop, its thread, training, evaluation)."""
    eng = AbortingEngine(steps=10**9, serves_one_version=one_version)
    loop = EngineLoop(lora=True, max_staleness=1)
    t = threading.Thread(target=loop.run, args=(eng,), daemon=True)
    t.start()
    train = Request(np.array([1, 2], np.int32), SAMPLING, stoppable=True)
    evaluation = Request(np.array([3], np.int32), SAMPLING)
    loop.submit(Sample(train))
    loop.submit(Sample(evaluation))
    while sum(e[0] == "add" for e in eng.events) < 2:
        pass
    return eng, loop, t, train, evaluation


@pytest.mark.parametrize("one_version", [False, True])
def test_a_training_request_that_can_no_longer_be_trained_is_stopped_and_nothing_else(one_version):
    """max_staleness 1: a training group's request on v0 runs on while v1 loads, and is stopped (StaleRequest, the
    engine told to abort it) once v2 is published; an evaluation's request on v0 runs to its end. An engine serving
    one version stops it as soon as v2 waits to load (which then loads without waiting for it)."""
    from tandem.rollout.engine_loop import StaleRequest

    eng, loop, t, train, evaluation = training_and_evaluation_running(one_version)
    if not one_version:
        load(loop, 1)
        assert not train.done.wait(0.2), "stopped one version behind, within max_staleness 1"
    v2 = LoadVersion(2, {})
    loop.submit(v2)
    finish(train)
    assert isinstance(train.error, StaleRequest) and train.error.version == 0 and train.result is None
    assert ("abort", 0) in eng.events and not evaluation.done.is_set()
    eng.left[1] = 1  # the evaluation ends at the next step
    finish(evaluation)
    assert v2.done.wait(5) and evaluation.error is None and evaluation.result is not None
    loop.stop()
    t.join(5)
    assert not any(e == ("abort", 1) for e in eng.events)


def test_trainable_from_stops_the_training_requests_of_older_versions_without_a_load():
    """max_staleness 1, v1 served: the controller takes the batch that was the last able to hold v0's groups
    (TrainableFrom(1)); the training request on v0 stops at once though no newer version is published, the one on
    v1 and an evaluation's on v0 run on."""
    from tandem.rollout.engine_loop import StaleRequest, TrainableFrom

    eng, loop, t, old, evaluation = training_and_evaluation_running(one_version=False)
    load(loop, 1)
    new = Request(np.array([4], np.int32), SAMPLING, min_version=1, stoppable=True)
    loop.submit(Sample(new))
    while sum(e[0] == "add" for e in eng.events) < 3:
        pass
    assert not old.done.wait(0.2), "one version behind, within max_staleness 1: runs on until told"
    loop.submit(TrainableFrom(1))
    finish(old)
    assert isinstance(old.error, StaleRequest) and old.error.version == 0 and "version 1 or newer" in str(old.error)
    assert not new.done.wait(0.2) and not evaluation.done.is_set() and loop.version == 1
    loop.stop()
    t.join(5)
    assert [e for e in eng.events if e[0] == "abort"] == [("abort", 0)]


def test_the_steps_a_stopped_request_ran_are_counted_times_its_sequences():
    """What a stop wasted: the engine steps between a training request's entry and its abort (the engine's own
    record), times its n sequences; the run's end (RunEnded) and an evaluation's request add nothing."""
    from tandem.rollout.engine_loop import StopTraining, TrainableFrom

    eng = AbortingEngine(steps=10**9)
    loop = EngineLoop(lora=True, max_staleness=1)
    t = threading.Thread(target=loop.run, args=(eng,), daemon=True)
    t.start()
    four = Sampling(n=4, max_tokens=4)
    old, last = (Request(np.array([1, 2], np.int32), four, stoppable=True) for _ in range(2))
    loop.submit(Sample(old))
    while ("add", 0, None) not in eng.events:
        pass
    while sum(e == ("step",) for e in eng.events) < 30:
        pass
    load(loop, 1)
    loop.submit(TrainableFrom(1))
    finish(old)
    ran = eng.events[eng.events.index(("add", 0, None)):eng.events.index(("abort", 0))].count(("step",))
    assert ran >= 30 and loop.timings()["stale_sequence_steps"] == 4 * ran
    assert loop.timings()["engine_steps"] == eng.events.count(("step",))  # every engine step, counted once
    loop.submit(Sample(last))
    while ("add", 1, 1) not in eng.events:
        pass
    steps = len(eng.events)
    while sum(e == ("step",) for e in eng.events[steps:]) < 10:
        pass
    loop.submit(StopTraining())
    finish(last)
    assert ("abort", 1) in eng.events
    loop.stop()
    t.join(5)
    assert loop.timings()["stale_sequence_steps"] == 4 * ran


def test_stop_training_stops_what_runs_and_waits_now_and_nothing_that_comes_later():
    """The run took its last batch (StopTraining): the training request running stops (RunEnded, a StaleRequest: the
    worker returns it as stopped), so does one waiting for a version not served yet; the evaluation's runs on, and
    a training request submitted afterwards runs to its end (one-shot, unlike TrainableFrom)."""
    from tandem.rollout.engine_loop import RunEnded, StopTraining

    eng, loop, t, train, evaluation = training_and_evaluation_running(one_version=False)
    early = Request(np.array([5], np.int32), SAMPLING, min_version=3, stoppable=True)
    loop.submit(Sample(early))
    loop.submit(StopTraining())
    finish(train, early)
    assert isinstance(train.error, RunEnded) and train.error.version == 0 and "last batch" in str(train.error)
    assert isinstance(early.error, RunEnded) and not early.started
    assert not evaluation.done.wait(0.2)
    later = Request(np.array([6], np.int32), SAMPLING, stoppable=True)
    loop.submit(Sample(later))
    while sum(e[0] == "add" for e in eng.events) < 3:
        pass
    assert not later.done.wait(0.2), "stopped by a StopTraining sent before it came"
    eng.left[2] = 1  # the later request ends at the next step
    finish(later)
    loop.stop()
    t.join(5)
    assert later.error is None and later.result is not None
    assert [e for e in eng.events if e[0] == "abort"] == [("abort", 0)]
