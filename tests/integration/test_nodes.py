"""Several Ray nodes on this machine: a rollout node lost mid-run (tests/integration/nodes_job.py, a process of its
own: one Ray per process)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import run_job_script

pytestmark = pytest.mark.integration


def test_a_lost_rollout_node_costs_its_worker_and_groups_not_the_job(tmp_path, tiny_model):
    """Controller on the head, the learner on a node of its own, two rollout nodes, max_staleness 1; one rollout
    node removed after cycle 2 with a group it scored in its object store, one that a coming batch trains on. The job
    is not restarted: the worker is replaced (its replacement waits for a node with `rollout` free, said in a line,
    while the job goes on with the other worker), the lost groups are sampled again before anything trains on them,
    and every cycle trains unique_prompts groups, none twice, each within the staleness bound."""
    r, said = run_job_script("tests.integration.nodes_job", str(tmp_path), tiny_model)
    assert r["workers_on_nodes"] == 2  # one worker on each rollout node
    assert r["learner_on_its_node"]
    assert r["steps"] == [1, 2, 3, 4] and r["metrics_lines"] == 4
    assert r["trained"] == r["distinct"] == r["trained_record"] == 8  # 2 prompts a cycle, none twice
    assert all(0 <= lag <= 1 for cycle in r["lags"] for lag in cycle), r["lags"]
    assert r["accounting"] == "ok", r["accounting"]
    # one lost node, one failure: a replacement Ray placed on the node before marking it dead is started again
    # without counting (rollout_pool.SAME_LOSS_S)
    assert r["counters"]["worker_failures"] == 1 and r["counters"].get("groups_lost", 0) >= 1, (r["counters"], said)
    assert any("rollout worker" in s and "died (" in s and "replaced (1 in a row)" in s for s in said), said
    assert not any("replaced (2 in a row)" in s for s in said), said
    assert any("not serving after" in s and "'rollout': 1.0" in s and "goes on with 1 worker(s)" in s
               for s in said), said
    assert any("scored group(s) lost with their node" in s and "nothing was trained on them" in s for s in said), said


def test_a_node_that_cannot_see_the_jobs_files_is_named_in_the_refusal(ray_head, tmp_path, tiny_model):
    """A node started in a mount namespace of its own with an empty tmpfs over the job's directory (as a second
    machine without the shared mount): the rollout worker Ray puts there refuses the job in one line naming itself,
    the node and what it cannot read (the model and the reward file), where the driver's node sees them all."""
    import os
    import shutil

    import yaml

    from tandem.services.devtools.local_nodes import BINDIR, join_nodes, stop, why_no_private_mounts

    if why := why_no_private_mounts():
        pytest.skip(why)
    job_dir = tmp_path / "job"
    shutil.copytree(tiny_model, job_dir / "model")
    (job_dir / "reward.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    (job_dir / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(8)))
    (job_dir / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(job_dir / "model"), "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
        "data": {"path": str(job_dir / "data.jsonl")}, "rewards": [f"{job_dir / 'reward.py'}:r"],
        "batch": {"num_generations": 4, "per_device_train_batch_size": 4, "max_steps": 1},
        "cluster": {"rollout_resources": {"num_cpus": 0, "resources": {"hidden_node": 1}}},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False}}))
    env = dict(os.environ, PATH=BINDIR + os.pathsep + os.environ["PATH"], RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=ray_head["token"])
    [node] = join_nodes(ray_head["gcs"], env, {"hidden_node": 1}, 0, 1, hide=[job_dir])
    try:
        run = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", "run", str(job_dir / "job.yaml"),
                              "--address", ray_head["gcs"]], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=180)
    finally:
        stop([node])
    said = [ln for ln in run.stderr.splitlines() if ln.startswith("tandem: ")]  # beside Ray's "Connecting to" lines
    assert run.returncode == 2 and len(said) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert said[0].startswith("tandem: invalid job on rollout worker 0, node "), said
    assert f"model.path = {str(job_dir / 'model')!r}: no config.json there" in said[0], said
    assert f"rewards[0] = '{job_dir / 'reward.py'}:r': file '{job_dir / 'reward.py'}' not found" in said[0], said
