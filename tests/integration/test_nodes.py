"""Several Ray nodes on this machine: a rollout node lost mid-run (tests/integration/nodes_job.py, a process of its
own: one Ray per process)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def test_a_lost_rollout_node_costs_its_worker_and_groups_not_the_job(tmp_path, tiny_model):
    """Learner and controller on the head, two rollout nodes, max_staleness 1; one rollout node removed after cycle 2
    with groups it scored in its object store. The job is not restarted: the worker is replaced (its replacement
    waits for a node with `rollout` free, said in a line, while the job goes on with the other worker), the lost
    groups are sampled again before anything trains on them, and every cycle trains unique_prompts groups, none
    twice, each within the staleness bound."""
    p = subprocess.run([sys.executable, "-m", "tests.integration.nodes_job", str(tmp_path), tiny_model], cwd=ROOT,
                       capture_output=True, text=True, timeout=400)
    said = [ln for ln in p.stderr.splitlines() + p.stdout.splitlines() if ln.startswith("tandem: ")]
    result = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and result, p.stderr[-4000:]
    r = json.loads(result[len("RESULT "):])
    assert r["workers_on_nodes"] == 2  # one worker on each rollout node
    assert r["steps"] == [1, 2, 3, 4] and r["metrics_lines"] == 4
    assert r["trained"] == r["distinct"] == r["trained_record"] == 8  # 2 prompts a cycle, none twice
    assert all(0 <= lag <= 1 for cycle in r["lags"] for lag in cycle), r["lags"]
    assert r["accounting"] == "ok", r["accounting"]
    # the lost worker (its calls may first fail as "unavailable", then as dead: one replacement or two)
    assert 1 <= r["counters"]["worker_failures"] <= 2 and r["counters"]["groups_lost"] >= 1, (r["counters"], said)
    assert any("rollout worker" in s and "died" in s and "replaced (1 in a row)" in s for s in said), said
    assert any("not serving after" in s and "'rollout': 1.0" in s and "goes on with 1 worker(s)" in s
               for s in said), said
    assert any("scored group(s) lost with their node" in s and "nothing was trained on them" in s for s in said), said
