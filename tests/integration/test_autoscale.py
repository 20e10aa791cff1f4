"""cluster.autoscale against Ray's own autoscaler (tests/integration/autoscale_job.py, a process of its own: one Ray
per process): the worker count follows the load, nodes really start and stop, nothing is lost or trained twice."""

import pytest

from tests.helpers import run_job_script

pytestmark = pytest.mark.integration


@pytest.mark.alone  # the worker count follows how long the learner waits: other tests' load would move it
def test_rollout_workers_follow_the_load_and_the_autoscaler_adds_and_removes_their_nodes(tmp_path, tiny_model):
    """The head holds no `rollout` resource: the autoscaler starts the first rollout node for the job's request.
    While the reward is slow the learner waits for groups: one worker more (bound 2), a second node started for it,
    and the added worker serves the adapter of the moment it joins and samples. Once the reward is instant a batch of groups
    waits in the buffer: one worker fewer, it stops once its prompts came back, and its idle node is removed.
    Every step has its metrics line, every prompt is trained once."""
    r, said = run_job_script("tests.integration.autoscale_job", str(tmp_path), tiny_model)
    seen = [tuple(x) for x in r["seen"]]  # per step: (cluster/rollout_workers, live nodes with `rollout`)
    assert seen[0] == (1, 1), seen  # the autoscaler's first node, asked for before the workers started
    grown, shrunk = r["grown_at"], r["shrunk_at"]
    assert grown and shrunk and grown < shrunk, r
    assert (2, 2) in seen[:grown] and seen[-1] == (1, 1) and r["node_gone_s"] < 30, (seen, r["node_gone_s"])
    assert all(w == 1 for w, _ in seen[shrunk - 1:]), seen
    assert r["added_version"][0] == r["added_version"][1] and r["added_groups"] > 0, r
    assert r["removed_dead"], "the removed worker still answers"
    c = r["counters"]
    assert r["scale_events"] == c["scale_events"] == 2 and c["workers_added"] == 1 and c["workers_removed"] == 1, c
    assert r["metrics_lines"] == r["steps"] and r["trained"] == r["distinct"] == 2 * r["steps"], r
    assert r["accounting"] == "ok", r["accounting"]
    assert any(s.startswith("tandem: autoscale: rollout workers 1 -> 2 (the learner waited ") for s in said), said
    assert any(s.startswith("tandem: autoscale: rollout workers 2 -> 1 (") and "groups waited in the buffer" in s
               for s in said), said
