"""Defects a test plants in a real run, to show that the test that should catch them does: each is a subclass of a
Ray actor class that breaks one thing inside its own process (where the learner or the rollout worker runs), handed
to the controller by patching the factory it calls in the driver (`plant`)."""

from __future__ import annotations

from tandem.learner.group import LearnerActor
from tandem.rollout.worker import RolloutWorker


def _flip_advantages() -> None:
    import tandem.learner.actor as actor

    right = actor.compute_advantages
    actor.compute_advantages = lambda *a, **k: -right(*a, **k)


class FlippedAdvantages(LearnerActor):
    def __init__(self, *args):
        _flip_advantages()
        super().__init__(*args)


class Unpublished(RolloutWorker):
    """Takes every published adapter and serves none of it: the version number moves, the policy does not."""

    def set_adapter(self, version: int, tensors) -> int:
        from tandem.core.protocol import as_torch

        return super().set_adapter(version, {k: v * 0 for k, v in as_torch(tensors).items()})


LEARNER = {"flipped_advantages": FlippedAdvantages}
ROLLOUT = {"unpublished": Unpublished}


def plant(monkeypatch, defect: str) -> None:
    """The controller of this test process builds its learner or rollout worker from the defective class."""
    import tandem.learner.group as group
    import tandem.rollout.worker as worker

    if defect in LEARNER:
        monkeypatch.setattr(group, "LearnerActor", LEARNER[defect])
    else:
        right = worker.rollout_actor_class
        monkeypatch.setattr(worker, "rollout_actor_class", lambda cfg, cls=ROLLOUT[defect]: right(cfg, cls))
