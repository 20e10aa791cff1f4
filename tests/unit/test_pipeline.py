"""The hand-out rule of max_staleness (services/orchestrator/pipeline.py) driven through a run: the prompts it hands
out are trained within the bound, it fills the bound (a lag of exactly k occurs: no idle engine short of it), at most
one batch of prompts goes out past the run's last (none at k = 0), and with k >= 1 the learner never waits for a
cycle's bookkeeping."""

from collections import deque

import pytest

from tandem.services.orchestrator.pipeline import prompts_wanted, trained_ahead_allowed


def run(U: int, k: int, batches: int, save_every: int = 0):
    """The controller's order of events with groups that come back the moment they are handed out (the fastest
    engine: what most tests the bound). -> (lags of every trained group, prompts handed out, batches trained ahead)."""
    version, left, queue, lags, handed, ahead = 0, batches, deque(), [], 0, 0
    training = None

    def fill(is_training: bool):
        nonlocal handed
        while len(queue) < prompts_wanted(U, k, is_training, left):
            queue.append(version)  # sampled with the version served now
            handed += 1

    while left:
        if training is None:  # collect
            fill(False)
            training = [queue.popleft() for _ in range(U)]
        fill(True)  # while it trains
        lags += [version - s for s in training]  # the learner at `version` trains it
        left, version = left - 1, version + 1  # trained, exported, sent
        saving = bool(save_every) and (batches - left) % save_every == 0
        if trained_ahead_allowed(k, left, saving, False) and len(queue) >= U:
            training, ahead = [queue.popleft() for _ in range(U)], ahead + 1
        else:
            training = None
        if k:
            fill(training is not None)  # fed ahead for the version just sent
    return lags, handed, ahead


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_the_bound_is_kept_and_filled_and_one_batch_at_most_goes_past_the_run(k):
    U, batches = 3, 12
    lags, handed, ahead = run(U, k, batches)
    assert len(lags) == U * batches
    # past the last batch: none at k = 0; at k >= 2 one batch (out while the one before the last trains); at k = 1
    # none here, where every group is back at once and the last batch starts training as the one before ends
    assert handed == U * (batches + (k >= 2))
    assert max(lags) == k and min(lags) >= 0
    assert ahead == (batches - 1 if k else 0)  # k >= 1: every batch after the first starts as the one before ends


def test_a_cycle_that_saves_trains_nothing_ahead():
    lags, handed, ahead = run(U=2, k=1, batches=9, save_every=3)
    assert max(lags) <= 1 and handed == 18
    assert ahead == 9 - 1 - 2  # the cycles ending at batches 3 and 6 save; the one ending at 9 is the last


def test_the_rule_in_numbers():
    assert prompts_wanted(8, 1, training=False, batches_left=10) == 16
    assert prompts_wanted(8, 1, training=True, batches_left=10) == 8
    assert prompts_wanted(8, 0, training=True, batches_left=10) == 0
    assert prompts_wanted(8, 3, training=True, batches_left=2) == 16  # the last batch's and one more to pick from
    assert prompts_wanted(8, 1, training=False, batches_left=1) == 16  # the last batch takes the first 8 of 16
    assert prompts_wanted(8, 0, training=False, batches_left=1) == 8  # k = 0: a batch waits for all of its own
    assert prompts_wanted(8, 3, training=True, batches_left=1) == 0  # every batch taken: nothing more goes out
    assert prompts_wanted(8, 1, training=False, batches_left=0) == 0
    # over-sampled prompts ride on top of the bound while a batch is untaken, and stop with the takes
    assert prompts_wanted(8, 1, training=False, batches_left=10, oversample=3) == 19
    assert prompts_wanted(8, 1, training=True, batches_left=10, oversample=3) == 11
    assert prompts_wanted(8, 1, training=True, batches_left=1, oversample=3) == 0
    assert not trained_ahead_allowed(1, 5, checkpoint_due=False, stopping=True)
    assert not trained_ahead_allowed(0, 5, checkpoint_due=False, stopping=False)
