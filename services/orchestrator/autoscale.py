"""Rollout workers that follow the load (`cluster.autoscale`): after each cycle the controller compares the time the
learner waited for groups with its training time, and the groups left waiting in the buffer with a batch, and
moves the worker count one step within the bounds. Ray's autoscaler is told what the new count needs
(`ray.autoscaler.sdk.request_resources`), so it adds a node for a worker that no node has room for and lets an
idle one go; `tandem scale` sets the count by hand between decisions."""

from __future__ import annotations

from dataclasses import dataclass

# the learner waited for groups longer than this share of its training time: a worker more
GROW_WAIT_SHARE = 0.2
# ... and longer than this: a shorter wait is the controller's own jitter (a poll, a Ray round trip), which a worker
# more, seconds to start, would not remove (on a 2-core CPU, cycles of 30-60 ms training waited 10-20 ms at times
# with enough workers, and the count went up and down)
GROW_MIN_WAIT_S = 0.05
# it waited less than this share while a whole batch of groups waited in the buffer: a worker less
SHRINK_WAIT_SHARE = 0.05


@dataclass(frozen=True)
class CycleLoad:
    """What one cycle says about the rollout side's capacity."""

    wait_s: float  # the learner waited for groups (the cycle's generate_wait_s)
    train_s: float
    buffered: int  # fresh groups left in the buffer after the batch was taken
    batch: int  # groups a cycle trains on (unique_prompts)
    starting: int  # workers asked for that do not serve yet (a node being added, an engine loading)


def next_worker_count(n: int, lo: int, hi: int, load: CycleLoad) -> int:
    """The worker count after a cycle: one more while the learner waits for data, one fewer while a batch of groups
    waits for the learner, never past [lo, hi], and no growth while a worker asked for is still starting (its
    node may be on its way)."""
    n_bounded = min(max(n, lo), hi)
    if n_bounded != n:
        return n_bounded
    if load.wait_s > max(GROW_WAIT_SHARE * load.train_s, GROW_MIN_WAIT_S) and load.starting == 0:
        return min(n + 1, hi)
    if load.wait_s < SHRINK_WAIT_SHARE * load.train_s and load.buffered >= load.batch:
        return max(n - 1, lo)
    return n


def request_rollout_resources(n: int, bundle: dict, learner: list[dict]) -> None:
    """Ray's autoscaler keeps room for n rollout workers and the learner ranks (what it is asked for replaces the last
    request: a smaller one lets idle nodes go)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[dict(bundle) for _ in range(n)] + [dict(b) for b in learner])


def bundle_of(resources) -> dict:
    """A role's resources (cluster.rollout_resources / learner_resources) as a Ray resource bundle."""
    b = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.resources}
    return {k: v for k, v in b.items() if v}


def request_job_resources(cfg, rollout_workers: int) -> None:
    """What the job needs with this many rollout workers, as one request to Ray's autoscaler."""
    c = cfg.cluster
    request_rollout_resources(rollout_workers, bundle_of(c.rollout_resources),
                              [bundle_of(c.learner_resources)] * c.num_processes)


def autoscale(cfg, pool, load: CycleLoad, counters) -> str | None:
    """After a cycle of a job with cluster.autoscale: the pool's worker count moved (applied at the next feed: a new
    worker starts with the current adapter, a removed one finishes what it holds) and Ray's autoscaler told.
    -> the line saying why, or None when the count stays."""
    a = cfg.cluster.autoscale
    if a is None:
        return None
    n = pool.target
    m = next_worker_count(n, a.min_rollout_workers, a.max_rollout_workers, load)
    if m == n:
        return None
    pool.scale(m)
    counters["scale_events"] += 1
    request_job_resources(cfg, m)
    why = (f"the learner waited {load.wait_s:.2f} s for groups, training {load.train_s:.2f} s" if m > n else
           f"{load.buffered} groups waited in the buffer, the learner {load.wait_s:.2f} s")
    return f"tandem: autoscale: rollout workers {n} -> {m} ({why})"


def wait_for_nodes(cfg, wait_s: float) -> None:
    """Every role's request fits some node (within wait_s), or a one-line error: an actor that no node can hold would
    wait forever, and the job and `tandem status` with it."""
    import time

    import ray

    from tandem.core.checks import resource_errors
    from tandem.core.config import JobConfigError

    end = time.time() + wait_s
    while errors := resource_errors(cfg, ray.nodes()):
        if time.time() >= end:
            raise JobConfigError("invalid job: " + "; ".join(errors) +
                                 (f" (waited {wait_s:.0f} s for a node to join)" if wait_s else ""))
        time.sleep(2)
