"""A job with `cluster.autoscale` on a Ray cluster whose nodes Ray's own autoscaler starts and stops (the fake
multi-node provider Ray's tests use, behind a `ray start --head --autoscaling-config`): the head holds the controller
and the learner; rollout workers need a `rollout` resource that only the autoscaler's nodes have. The reward is slow
(the learner waits for groups: a worker more, and a node for it) until a flag file appears, then instant (groups
wait in the buffer: a worker less, and its node goes idle and is removed). Run by tests/integration/test_autoscale.py
in a process of its own; prints one JSON line of what happened.

    python -m tests.integration.autoscale_job WORK_DIR MODEL_DIR"""

import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROWS = 400  # one epoch: the run ends before it does

SLOW_UNTIL_FLAG = '''
import os, time
def r(completions, **kw):
    if not os.path.exists(FLAG):
        time.sleep(0.4)  # the learner waits for groups
    return [float(len(c) % 4) for c in completions]
'''


def main(work: str, model: str) -> None:
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))  # read when ray is imported
    import ray

    from tandem.services.devtools.local_nodes import start_autoscaling_head, stop
    from tandem.services.orchestrator.controller import Controller
    from tests.helpers import make_job
    from tests.integration.test_loop import check_accounting

    tmp = Path(work)
    flag = tmp / "fast"
    (tmp / "reward.py").write_text(f"FLAG = {str(flag)!r}\n" + SLOW_UNTIL_FLAG)
    (tmp / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(ROWS)))
    head, gcs = start_autoscaling_head(
        dict(os.environ), tempfile.mkdtemp(prefix="ray"), head_cpus=2,
        worker_node_types={"rollout_node": {"resources": {"CPU": 1, "rollout": 1}, "node_config": {},
                                            "min_workers": 0, "max_workers": 2}},
        idle_timeout_minutes=0.05)
    try:
        ray.init(address=gcs)
        cfg = make_job(tmp, model, [f"{tmp / 'reward.py'}:r"], model={"fast_inference": False},
                       batch={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 400},
                       cluster={"num_rollout_workers": 1, "max_staleness": 1, "rollout_prompts_in_flight": 2,
                                "autoscale": {"min_rollout_workers": 1, "max_rollout_workers": 2},
                                "rollout_resources": {"num_cpus": 1, "resources": {"rollout": 1}}},
                       generation={"max_completion_length": 8}, optimizer={"learning_rate": 1e-2},
                       logging={"output_dir": str(tmp / "run"), "progress": False})
        ctl = Controller(cfg)
        ctl.setup(resource_wait_s=120)  # the first rollout node is the autoscaler's to start
        seen = []  # per step: (rollout workers the metrics line says, alive nodes with a `rollout` resource)
        grown_at = shrunk_at = added = added_version = node_gone_s = None
        added_groups = 0
        while True:
            r = ctl.step()
            nodes = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("rollout"))
            seen += [(s["cluster/rollout_workers"], nodes) for s in r["steps"]]
            if grown_at is None and any(w == 2 and n == 2 for w, n in seen) and len(ctl.workers) == 2 \
                    and not ctl.pool.starting(0):
                grown_at = len(seen)
                added = ctl.workers[1]  # it serves the adapter of now, whatever was published while it started
                added_version = (ray.get(added.health.remote())["version"], ctl.version)
                flag.write_text("")  # from now on the workers outpace the learner
            if added is not None and shrunk_at is None:  # what the added worker sampled while it was there
                try:
                    added_groups = ray.get(added.stats.remote())["groups"]
                except ray.exceptions.RayActorError:
                    pass  # removed this step
            if grown_at and shrunk_at is None and seen[-1][0] == 1:
                shrunk_at, t_shrunk = len(seen), time.time()
            if shrunk_at and seen[-1] == (1, 1):
                node_gone_s = time.time() - t_shrunk
                break
            if r["done"] or (shrunk_at and time.time() - t_shrunk > 60):
                break
        try:  # the removed worker stopped once its prompts came back
            ray.get(added.health.remote(), timeout=30)
            removed_dead = False
        except ray.exceptions.RayActorError:
            removed_dead = True
        try:
            check_accounting(ctl, ROWS)
            accounting = "ok"
        except AssertionError as e:
            import traceback

            accounting = str(e) or traceback.format_exc()[-600:]
        lines = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
        out = {"seen": seen, "added_version": added_version, "added_groups": added_groups, "removed_dead": removed_dead, "grown_at": grown_at, "shrunk_at": shrunk_at, "node_gone_s": node_gone_s, "accounting": accounting,
               "steps": len(seen), "metrics_lines": len(lines), "trained": len(ctl.seen),
               "distinct": len({(e, i) for e, i, _ in ctl.seen}), "counters": dict(ctl.counters),
               "scale_events": json.loads(lines[-1]).get("cluster/scale_events")}
        ctl.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
        ray.shutdown()
    finally:
        stop([head])
        time.sleep(0.5)


if __name__ == "__main__":
    main(*sys.argv[1:3])
