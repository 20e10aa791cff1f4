"""A job on a Ray cluster of three nodes on this machine (ray.cluster_utils.Cluster, what Ray's own tests use): the
head holds the controller, a node with a `learner` resource the learner (its rendezvous on that node, not the
driver's), two nodes with a `rollout` resource hold one rollout worker each. After the second cycle one rollout node
is removed while a group it scored, one a coming batch trains on, waits in its object store (groups are kept out of
the owner's memory: max_direct_call_object_size). Run by tests/integration/test_nodes.py in a process of its own
(one Ray per process); prints one JSON line of what happened.

    python -m tests.integration.nodes_job RUN_DIR MODEL_DIR"""

import json
import sys
import time
from pathlib import Path


def main(run_dir: str, model: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from tandem.services.orchestrator import rollout_pool
    from tandem.services.orchestrator.controller import Controller
    from tests.helpers import ROOT, make_job
    from tests.integration.test_loop import check_accounting

    rollout_pool.WAIT_NOTE_S = 2.0  # the line every 10 s, sooner

    cluster = Cluster(initialize_head=True, head_node_args={  # groups live where they were scored, not in the owner
        "num_cpus": 2, "_system_config": {"max_direct_call_object_size": 256,
        "health_check_period_ms": 500, "health_check_failure_threshold": 3}})  # a lost node seen in ~2 s, not 15
    learner_node = cluster.add_node(num_cpus=1, resources={"learner": 1})
    rollout_nodes = [cluster.add_node(num_cpus=1, resources={"rollout": 1}) for _ in range(2)]
    ray.init(address=cluster.address)
    tmp = Path(run_dir)
    cfg = make_job(tmp, model, [f"{ROOT}/examples/rewards.py:digits_reward"],
                   model={"fast_inference": False}, reward_timeout_s=None,
                   batch={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 4},
                   cluster={"num_rollout_workers": 2, "max_staleness": 1, "rollout_prompts_in_flight": 2,
                            "rollout_resources": {"num_cpus": 1, "resources": {"rollout": 1}},
                            "learner_resources": {"num_cpus": 1, "resources": {"learner": 1}}},
                   generation={"max_completion_length": 8}, optimizer={"learning_rate": 1e-2},
                   logging={"output_dir": str(tmp / "run"), "progress": False})
    ctl = Controller(cfg)
    ctl.setup()
    nodes_of = {}
    for w in ctl.workers:
        nodes_of[ray.get(w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))] = w
    learner_nodes = {p["node"] for p in ray.get(ctl.learner._placed)}
    steps, removed_at = [], None
    while True:
        r = ctl.step()
        steps += [s["step"] for s in r["steps"]]
        if len(steps) == 2:  # the node holding a scored group that a coming batch will train on goes
            # one sampled with the version just published: fresh for the next two batches (an older one may go stale
            # first, and be sampled again without anyone fetching it)
            while (ref := next((r for m, r in ctl.buffer.groups if m["version"] >= ctl.version), None)) is None:
                ctl._gather(2 * ctl.plan.unique_prompts, timeout=1.0)
            end = time.time() + 30
            while True:  # the owner learns where an object is a moment after it has it (an empty list before)
                where = ray.experimental.get_object_locations([ref])[ref]["node_ids"]
                victim = next((n for n in rollout_nodes if n.node_id in where), None)
                if victim is not None or time.time() > end:
                    break
                time.sleep(0.1)
            assert victim is not None, f"the group's object is on none of the rollout nodes: {where}"
            cluster.remove_node(victim, allow_graceful=False)
            removed_at = time.time()
        if len(steps) == 3:
            time.sleep(2.5)  # the replacement cannot start (no other node has `rollout` free): said meanwhile
        if r["done"]:
            break
    trained = [(e, i) for e, i, _ in ctl.seen]
    U = ctl.plan.unique_prompts  # the version each cycle's groups were sampled with: within max_staleness
    lags = [[c - v for *_, v in list(ctl.seen)[c * U:(c + 1) * U]] for c in range(len(steps))]
    try:
        check_accounting(ctl, 16)  # every epoch-0 prompt trained or pending, none trained twice, the record agrees
        accounting = "ok"
    except AssertionError as e:
        accounting = str(e) or "failed"
    out = {"lags": lags, "accounting": accounting, "pending": len(ctl.pool.pending_items()) + len(ctl.buffer.pending()),"steps": steps, "trained": len(trained), "distinct": len(set(trained)), "counters": dict(ctl.counters),
           "metrics_lines": len((tmp / "run" / "metrics.jsonl").read_text().splitlines()),
           "trained_record": len(ctl.trained), "workers_on_nodes": len(nodes_of),
           "learner_on_its_node": learner_nodes == {learner_node.node_id} != {cluster.head_node.node_id},
           "removed_after_s": time.time() - removed_at}
    ctl.shutdown()
    print("RESULT " + json.dumps(out, default=int), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
