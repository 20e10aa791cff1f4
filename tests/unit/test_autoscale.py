"""The autoscaling policy (services/orchestrator/autoscale.py) on plain numbers, and its job-file section."""

import pytest

from tandem.core.config import JobConfig, JobConfigError
from tandem.services.orchestrator.autoscale import (
    GROW_MIN_WAIT_S,
    GROW_WAIT_SHARE,
    SHRINK_WAIT_SHARE,
    CycleLoad,
    bundle_of,
    next_worker_count,
)


def load(wait, train=10.0, buffered=0, batch=4, starting=0):
    return CycleLoad(wait_s=wait, train_s=train, buffered=buffered, batch=batch, starting=starting)


def test_a_learner_waiting_for_groups_gets_a_worker_more_within_the_bound():
    assert next_worker_count(2, 1, 4, load(wait=GROW_WAIT_SHARE * 10 + 0.1)) == 3
    assert next_worker_count(4, 1, 4, load(wait=9.0)) == 4  # at the bound
    assert next_worker_count(2, 1, 4, load(wait=GROW_WAIT_SHARE * 10 - 0.1)) == 2  # a short wait is noise
    assert next_worker_count(2, 1, 4, load(wait=9.0, starting=1)) == 2  # the last one asked for still starts
    short = GROW_MIN_WAIT_S / 2  # half a 0.03 s training, yet jitter: no worker more
    assert next_worker_count(2, 1, 4, load(wait=short, train=0.03)) == 2
    assert next_worker_count(2, 1, 4, load(wait=GROW_MIN_WAIT_S + 0.01, train=0.03)) == 3


def test_groups_waiting_for_the_learner_cost_a_worker_within_the_bound():
    idle = SHRINK_WAIT_SHARE * 10 - 0.01
    assert next_worker_count(3, 1, 4, load(wait=idle, buffered=4)) == 2
    assert next_worker_count(1, 1, 4, load(wait=idle, buffered=8)) == 1  # at the bound
    assert next_worker_count(3, 1, 4, load(wait=idle, buffered=3)) == 3  # less than a batch waits: keep them
    assert next_worker_count(3, 1, 4, load(wait=1.0, buffered=8)) == 3  # the learner waited too: keep them


def test_a_count_outside_the_bounds_is_brought_inside_first():
    assert next_worker_count(6, 1, 4, load(wait=9.0)) == 4  # `tandem scale 6` past the bound
    assert next_worker_count(1, 2, 4, load(wait=0.0, buffered=9)) == 2


def test_the_section_is_checked_and_the_request_bundles_are_rays():
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"]}
    cfg = JobConfig.from_dict({**base, "cluster": {"autoscale": {"min_rollout_workers": 1, "max_rollout_workers": 3},
                                                   "rollout_resources": {"num_cpus": 2, "num_gpus": 1,
                                                                         "resources": {"rollout": 1}}}})
    assert cfg.cluster.autoscale.max_rollout_workers == 3
    assert bundle_of(cfg.cluster.rollout_resources) == {"CPU": 2, "GPU": 1, "rollout": 1}
    assert JobConfig.from_dict(base).cluster.autoscale is None  # off by default
    with pytest.raises(JobConfigError, match=r"cluster.autoscale: min_rollout_workers = 3 > max_rollout_workers = 2"):
        JobConfig.from_dict({**base, "cluster": {"autoscale": {"min_rollout_workers": 3, "max_rollout_workers": 2}}})
    with pytest.raises(JobConfigError, match=r"cluster.num_rollout_workers = 5: outside cluster.autoscale's bounds"):
        JobConfig.from_dict({**base, "cluster": {"num_rollout_workers": 5,
                                                 "autoscale": {"min_rollout_workers": 1, "max_rollout_workers": 2}}})


def test_a_worker_count_below_one_is_refused_by_name(tmp_path):
    """`tandem scale` reaches Controller.scale: the count is checked before the pool is touched."""
    from tandem.services.orchestrator.controller import Controller

    cfg = JobConfig.from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"],
                               "logging": {"output_dir": str(tmp_path)}})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"scale: num_rollout_workers = {bad!r}; allowed a whole number >= 1"):
            Controller(cfg).scale(bad)


def test_the_field_description_states_the_policys_shares():
    from tandem.core.config import ClusterConfig

    text = ClusterConfig.model_fields["autoscale"].description
    assert f"{GROW_WAIT_SHARE} x its training time" in text and f"{SHRINK_WAIT_SHARE} x" in text
