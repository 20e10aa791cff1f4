"""The chaos table: the demo job (examples/sevens.yaml, its model built here) on a local Ray cluster of four nodes, the
run directory in an S3 bucket (moto's server), one fault per run, and what each fault cost.

The cluster, as CLUSTER.md-style tests build it (`tandem.services.devtools.local_nodes`): a token-auth head (the
controller and the driver), one rollout node and two learner nodes, each worker node in a mount namespace of its own
with an empty tmpfs over the job's directory and the staging directory (a second machine's view: the model comes
from the bucket, the job through Ray). The job runs `tandem run --address` at `max_staleness: 1` with an evaluation
every 8 steps and a checkpoint every 4, for 24 steps, `cluster.max_restarts: 3`.

Each fault waits for step 2 in the bucket, then for its moment: the Ray method it names seen RUNNING by Ray's state
API (task events every 100 ms on every node), then SIGKILLs every process of the node (a machine lost), or the one
process named. A lost rollout node is followed, 5 s later, by a fresh node with the same resources (a replacement
machine; an autoscaler's). Faults:

  none                  the baseline (its wall time is what the others' "lost" counts from)
  rollout_generating    the rollout node while RolloutWorker.rollout samples a training group
  rollout_evaluating    the rollout node while RolloutWorker.generate runs an evaluation
  rollout_publishing    the rollout node while RolloutWorker.set_adapter takes a published adapter
  learner_training      the learner's node while LearnerActor.train runs a step
  learner_checkpointing the learner's node while LearnerActor.save_checkpoint writes to the bucket
  controller            the controller actor's process (the head holds Ray's control store, so not the head)
  driver                the driver (`tandem run`'s supervised child)

Per run: rc, the steps in the bucket's metrics.jsonl (missing, twice), the prompts the final checkpoint records as
trained (one bit per prompt and epoch: trained twice cannot load) against steps x prompts a step, the prompts handed
out and left for a resume, the wall time lost against `none`, and the `tandem:` lines the user saw after the kill.

  python3 bench/chaos.py run [--faults none,rollout_generating,...] [--out bench/results/chaos_raw]
  python3 bench/chaos.py table bench/results/chaos_raw        # bench/results/chaos.md holds what it printed
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tandem.services.devtools.local_nodes import actor_pid, kill_node  # noqa: E402 - after the path above

BUCKET = "tandem-chaos"
STEPS, EVAL_STEPS, SAVE_STEPS, PROMPTS_PER_STEP = 24, 8, 4, 4
REJOIN_S = 5.0  # a lost rollout node's replacement joins this long after the loss
FAULTS = {  # name: (what is killed, the Ray method whose RUNNING call is the moment)
    "none": (None, None),
    "rollout_generating": ("rollout", "RolloutWorker.rollout"),
    "rollout_evaluating": ("rollout", "RolloutWorker.generate"),
    "rollout_publishing": ("rollout", "RolloutWorker.set_adapter"),
    "learner_training": ("learner", "LearnerActor.train"),
    "learner_checkpointing": ("learner", "LearnerActor.save_checkpoint"),
    "controller": ("controller", None),
    "driver": ("driver", None),
}


class Bucket:
    """moto's S3 server on a free port with one bucket; read back with boto3, not with the code under test."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        from tandem.services.devtools.local_nodes import free_port

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        self.env = {"AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], aws_access_key_id="chaos",
                               aws_secret_access_key="chaos", region_name="us-east-1")
        self.s3.create_bucket(Bucket=BUCKET)

    def keys(self, prefix: str) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def read(self, key: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def steps(self, run: str) -> list[int]:
        text = (self.read(f"{run}/metrics.jsonl") or b"").decode()
        return [json.loads(x)["step"] for x in text.splitlines() if x.strip()]


def prepare(work: Path, bucket: Bucket) -> str:
    """The demo's model, prompts and eval set (built once under work/sevens), the model uploaded -> its URI."""
    from examples.sevens.prepare import main as build

    if not (work / "sevens" / "model" / "config.json").is_file():
        build(str(work / "sevens"))
    for f in (work / "sevens" / "model").iterdir():
        bucket.s3.upload_file(str(f), BUCKET, f"models/sevens/{f.name}")
    return f"s3://{BUCKET}/models/sevens"


def job_file(job_dir: Path, work: Path, model_uri: str, run: str) -> None:
    import shutil

    import yaml

    from tandem.core.config import JobConfig

    job_dir.mkdir(parents=True)
    for name in ("prompts.jsonl", "eval.jsonl"):
        shutil.copy(work / "sevens" / name, job_dir / name)
    d = JobConfig.from_yaml(ROOT / "examples" / "sevens.yaml").model_dump(mode="json", exclude_unset=True)
    d["model"]["path"] = model_uri
    d["data"]["path"] = "prompts.jsonl"
    d["rewards"] = [f"{ROOT / 'examples' / 'rewards.py'}:sevens_reward"]  # code every node has
    d["batch"]["max_steps"] = STEPS
    d["cluster"] = {"max_staleness": 1, "max_restarts": 3,
                    "rollout_resources": {"num_cpus": 1, "resources": {"rollout": 1}},
                    "learner_resources": {"num_cpus": 1, "resources": {"learner": 1}}}
    d["eval"] = {**d["eval"], "path": "eval.jsonl", "eval_steps": EVAL_STEPS, "eval_on_start": False}
    d["checkpoint"] = {"save_steps": SAVE_STEPS, "save_total_limit": 2}
    d["logging"] = {"output_dir": f"s3://{BUCKET}/{run}", "progress": False}
    (job_dir / "job.yaml").write_text(yaml.safe_dump(d))


WATCH = """
import sys, time
from ray.util.state import list_tasks
method, gcs = sys.argv[1:3]
while not list_tasks(address=gcs, filters=[("name", "=", method), ("state", "=", "RUNNING")], limit=10,
                     raise_on_missing_output=False, timeout=10):
    time.sleep(0.05)
"""
FAILED = """
import sys
from ray.util.state import list_tasks
method, gcs = sys.argv[1:3]
print(len(list_tasks(address=gcs, filters=[("name", "=", method), ("state", "=", "FAILED")], limit=100,
                     raise_on_missing_output=False, timeout=30)))
"""


def wait_running(method: str, env: dict, gcs: str, p) -> None:
    """Until a call of `method` (e.g. 'RolloutWorker.generate') runs on the cluster, by Ray's state API, asked from a
    process of its own that holds the cluster's token (Ray reads its auth settings once per process)."""
    w = subprocess.Popen([sys.executable, "-c", WATCH, method, gcs], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: w.poll() is not None, p, f"{method} running", poll=0.02)
    finally:
        if w.poll() is None:
            w.kill()
    if w.returncode != 0:
        raise RuntimeError(f"watching for {method}: {w.stderr.read()[-2000:]}")


def failed_calls(method: str, env: dict, gcs: str) -> int | None:
    """How many calls of `method` Ray's state API records as failed (a kill during one fails it)."""
    q = subprocess.run([sys.executable, "-c", FAILED, method, gcs], env=env, capture_output=True, text=True,
                       timeout=120)
    return int(q.stdout.split()[-1]) if q.returncode == 0 and q.stdout.split() else None


class Cluster:
    """The head, the rollout node and two learner nodes (see the module's doc)."""

    def __init__(self, env: dict, hide: list[Path]):
        from tandem.services.devtools.local_nodes import join_nodes, start_head

        self.env, self.hide = env, hide
        self.head, self.gcs = start_head(env, tempfile.mkdtemp(prefix="ray"), num_cpus=1)
        self.learners = join_nodes(self.gcs, env, {"learner": 1}, 1, 2, hide=hide)
        self.rollout = self.new_rollout_node()

    def new_rollout_node(self):
        from tandem.services.devtools.local_nodes import join_nodes

        [node] = join_nodes(self.gcs, self.env, {"rollout": 1}, 1, 1, hide=self.hide)
        return node

    def learner_node(self):
        return next((n for n in self.learners if n.poll() is None and actor_pid(n.pid, "LearnerActor")), None)

    def stop(self) -> None:
        from tandem.services.devtools.local_nodes import stop

        stop([self.rollout, *self.learners, self.head])


def run_fault(fault: str, bucket: Bucket, work: Path, model_uri: str) -> dict:
    """One run of the demo job on a fresh cluster with `fault` -> its row."""
    from tandem.services.devtools.local_nodes import BINDIR, why_no_private_mounts

    run = f"runs/{fault}"
    job_dir, staging = work / fault / "job", work / fault / "staging"
    job_file(job_dir, work, model_uri, run)
    staging.mkdir(parents=True)
    env = dict(os.environ, **bucket.env, TANDEM_STAGING_DIR=str(staging), TANDEM_MODEL_CACHE=str(staging / "models"),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
               PATH=BINDIR + os.pathsep + os.environ["PATH"], RAY_health_check_period_ms="500",
               RAY_health_check_failure_threshold="3", RAY_task_events_report_interval_ms="100")
    private = why_no_private_mounts() is None
    cluster = Cluster(env, [job_dir, staging] if private else [])
    text: list[str] = []
    row: dict = {"fault": fault, "private_mounts": private}
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", "tandem.services.app.cli", "run", "job.yaml", "--address",
                          cluster.gcs], cwd=job_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    threading.Thread(target=lambda: text.extend(p.stdout), daemon=True).start()
    try:
        if fault != "none":
            row.update(inject(fault, cluster, p, bucket, run, env, lambda: len("".join(text))))
        rc = p.wait(900)
    finally:
        if p.poll() is None:
            p.kill()
        cluster.stop()
    rows = len((job_dir / "prompts.jsonl").read_text().splitlines())
    row.update(rc=rc, wall_s=round(time.time() - t0, 1), **outcome(bucket, run, rows))
    out = "".join(text)
    after = out[row["killed_at_chars"]:] if "killed_at_chars" in row else ""
    row["said"] = [ln.strip() for ln in after.splitlines() if ln.strip().startswith("tandem:")][:6]
    (work / fault / "driver.txt").write_text(out)
    return row


def inject(fault: str, cluster: Cluster, p, bucket: Bucket, run: str, env: dict, said_so_far) -> dict:
    """Waits for step 2 in the bucket, then for the fault's moment, and kills -> what was killed, and when (the step,
    the method, how much the driver had printed: `said_so_far()`)."""
    what, method = FAULTS[fault]
    until(lambda: len(bucket.steps(run)) >= 2, p, "step 2 in the bucket")
    if method:
        wait_running(method, env, cluster.gcs, p)
    at = {"killed_after_step": max(bucket.steps(run), default=0), "killed_during": method or what,
          "killed_at_chars": said_so_far()}
    if what == "rollout":
        kill_node(cluster.rollout.pid)
        time.sleep(REJOIN_S)
        cluster.rollout = cluster.new_rollout_node()
    elif what == "learner":
        node = until(cluster.learner_node, p, "the learner's node")
        kill_node(node.pid)
    elif what == "controller":
        os.kill(until(lambda: actor_pid(cluster.head.pid, "Controller"), p, "the controller"), signal.SIGKILL)
    elif what == "driver":
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        os.kill(int(kids[0]), signal.SIGKILL)
    if method:  # did the kill land during the call, or just after it ended (the state API lags ~100 ms)?
        time.sleep(3.0)
        at["call_failed"] = failed_calls(method, env, cluster.gcs)
    return at


def until(cond, p, what: str, timeout: float = 600, poll: float = 0.2):
    end = time.time() + timeout
    while time.time() < end:
        if p.poll() is not None:
            raise RuntimeError(f"the job ended (rc {p.returncode}) before {what}")
        if v := cond():
            return v
        time.sleep(poll)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def outcome(bucket: Bucket, run: str, rows: int) -> dict:
    """The bucket's steps and the final checkpoint's record of trained prompts (`rows`: the prompts file's)."""
    from tandem.services.orchestrator.controller import parts_state
    from tandem.services.orchestrator.epoch_record import EpochRecord

    steps = bucket.steps(run)
    metas = [k for k in bucket.keys(f"{run}/checkpoints/") if k.endswith("/tandem.json")]
    got = {"steps": len(steps), "steps_missing": len(set(range(1, STEPS + 1)) - set(steps)),
           "steps_twice": len(steps) - len(set(steps))}
    if metas:
        meta = json.loads(bucket.read(max(metas)))
        part = parts_state(meta["controller"], rows)
        record = EpochRecord(rows)
        try:
            record.load(part["record"]["trained"])  # a prompt trained twice cannot load
            got["prompts_trained"] = len(record.pairs())
            got["prompts_trained_twice"] = 0
        except ValueError as e:
            got["prompts_trained"], got["prompts_trained_twice"] = None, str(e)
        got["prompts_left_for_a_resume"] = len(part["source"].get("requeued", []))
        got["checkpoint_steps"] = meta["steps"]
    got["prompts_expected"] = len(steps) * PROMPTS_PER_STEP
    return got


def table(folder: Path) -> str:
    rows = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json")) if f.name != "machine.json"]
    order = list(FAULTS)
    rows.sort(key=lambda r: order.index(r["fault"]) if r["fault"] in order else 99)
    base = next((r["wall_s"] for r in rows if r["fault"] == "none"), None)
    out = ["| fault | killed after step (during the call: failed calls) | rc | steps in the bucket (missing / twice) | prompts trained / expected "
           "(twice) | left for a resume | wall s (lost) | what the user saw after it |",
           "| --- | --: | --: | --: | --: | --: | --: | --- |"]
    for r in rows:
        lost = f"{r['wall_s'] - base:+.0f}" if base is not None and r["fault"] != "none" else "—"
        said = "<br>".join(s.replace("|", "/")[:200] for s in r.get("said", [])[:3]) or "—"
        during = f" ({r['call_failed']})" if r.get("call_failed") is not None else ""
        out.append(f"| {r['fault']} | {r.get('killed_after_step', '—')}{during} | {r['rc']} | {r['steps']} "
                   f"({r['steps_missing']} / {r['steps_twice']}) | {r.get('prompts_trained')} / "
                   f"{r['prompts_expected']} ({r.get('prompts_trained_twice')}) | "
                   f"{r.get('prompts_left_for_a_resume')} | {r['wall_s']:.0f} ({lost}) | {said} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run", "table"])
    ap.add_argument("folder", nargs="?", default="bench/results/chaos_raw")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    out = Path(a.folder)
    if a.what == "table":
        print(table(out))
        return
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="chaos-"))
    bucket = Bucket()
    model_uri = prepare(work, bucket)
    import ray

    (out / "machine.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                  "machine": f"{platform.processor() or platform.machine()}, "
                                                             f"{os.cpu_count()} cores", "ray": ray.__version__,
                                                  "python": platform.python_version()}))
    for fault in a.faults.split(","):
        if fault not in FAULTS:
            raise SystemExit(f"--faults: {fault!r} is not one of {', '.join(FAULTS)}")
        print(f"== {fault}", flush=True)
        try:
            row = run_fault(fault, bucket, work, model_uri)
        except Exception as e:  # the table says it; the next fault still runs
            row = {"fault": fault, "rc": None, "wall_s": 0.0, "steps": 0, "steps_missing": STEPS, "steps_twice": 0,
                   "prompts_expected": 0, "said": [f"chaos.py: {type(e).__name__}: {e}"]}
        (out / f"{fault}.json").write_text(json.dumps(row, indent=1))
        print(json.dumps(row), flush=True)
    print(table(out))


if __name__ == "__main__":
    main()
