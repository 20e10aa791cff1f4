"""A run whose logging.output_dir is a storage URI, against a real S3 API (moto's server: every request is HTTP to
it, as to a bucket), nothing of pyarrow mocked: the run's files and checkpoints land in the bucket, a killed learner's
job resumes from the bucket's newest checkpoint, and `tandem export` reads the adapter back from it."""

import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tandem.services.devtools.local_nodes import actor_pid, kill_node
from tests.integration.test_faults import STEADY_REWARD, wait_for

pytestmark = pytest.mark.integration

BUCKET = "tandem-runs"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on a free port, one bucket; -> the environment a node gives pyarrow and boto3."""
    from moto.server import ThreadedMotoServer  # the dev extra's: `make install` brings it

    from tandem.services.devtools.local_nodes import free_port

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "tandem-test", "AWS_SECRET_ACCESS_KEY": "tandem-test", "AWS_DEFAULT_REGION":
           "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    s3_client(env).create_bucket(Bucket=BUCKET)
    yield env
    server.stop()


def s3_client(s3_env: dict):
    import boto3

    return boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], aws_access_key_id="tandem-test",
                        aws_secret_access_key="tandem-test", region_name="us-east-1")


def bucket_files(s3_env: dict, prefix: str, suffix: str = "") -> dict[str, bytes]:
    """Every object under prefix (whose key ends with suffix), read back with boto3 (not with the code under test)."""
    c = s3_client(s3_env)
    keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", []) if o["Key"].endswith(suffix)]
    return {k[len(prefix):]: c.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def test_a_run_in_a_bucket_survives_the_loss_of_its_learners_node_and_exports_from_it(s3, tmp_path, tiny_model):
    """A `ray start` head (the controller) and two nodes with a `learner` resource, each in a mount namespace of its
    own with an empty tmpfs over the job's directory (the job file and its data, which the controller reads once) and
    the staging directory (the reward file lies elsewhere, as code every node has; where `unshare -m` is not allowed
    here they see this machine's files, and the rest is the same); `vllm_mode: colocate`, so one actor on a learner
    node holds the learner and rollout worker 0. The run directory is an S3 bucket. After the first checkpoint
    reaches the bucket, every process of that node is killed: the colocated actor's death is the learner's, the job
    restarts, its actor starts on the other node and resumes from the bucket's newest checkpoint; the bucket then
    holds one metrics line per step, the checkpoints save_total_limit keeps, the adapter and the plot, and
    `tandem export` merges the adapter it reads from there. The model too is read from the bucket: each node copies
    it once into its own cache (the learner nodes' caches are private), and the adapter names the URI as its base."""
    import secrets
    import tempfile

    import yaml

    from tandem.services.devtools.local_nodes import (
        BINDIR,
        join_nodes,
        start_head,
        stop,
        why_no_private_mounts,
    )

    private = why_no_private_mounts() is None
    job_dir, staging = tmp_path / "job", tmp_path / "staging"
    job_dir.mkdir()
    staging.mkdir()
    (tmp_path / "reward.py").write_text(STEADY_REWARD)
    (job_dir / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(16)))
    uri, model_uri = f"s3://{BUCKET}/jobs/run", f"s3://{BUCKET}/models/tiny"
    client = s3_client(s3)
    for f in Path(tiny_model).iterdir():  # the model as a user keeps it in a bucket; each node copies it once
        client.upload_file(str(f), BUCKET, f"models/tiny/{f.name}")
    (job_dir / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": model_uri, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
        "data": {"path": "data.jsonl"}, "rewards": [f"{tmp_path / 'reward.py'}:r"],
        "generation": {"max_prompt_length": 64, "max_completion_length": 8},
        "batch": {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 8},
        "optimizer": {"learning_rate": 1e-2}, "checkpoint": {"save_steps": 2, "save_total_limit": 2},
        "cluster": {"vllm_mode": "colocate", "learner_resources": {"num_cpus": 1, "resources": {"learner": 1}}},
        "logging": {"output_dir": uri, "progress": False}}))
    env = dict(os.environ, **s3, TANDEM_STAGING_DIR=str(staging), TANDEM_MODEL_CACHE=str(staging / "models"),
               RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(16), PATH=BINDIR + os.pathsep + os.environ["PATH"],
               RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="3")  # a lost node in ~2 s
    head, gcs = start_head(env, tempfile.mkdtemp(prefix="ray"), num_cpus=1)  # short: socket paths < 108 bytes
    nodes: list = []
    text: list[str] = []
    p = None
    try:
        nodes = join_nodes(gcs, env, {"learner": 1}, 2, 2, hide=[job_dir, staging] if private else [])
        p = subprocess.Popen([sys.executable, "-m", "tandem.services.app.cli", "run", "job.yaml", "--address", gcs],
                             cwd=job_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: text.extend(p.stdout), daemon=True).start()

        def running(cond):
            def check():
                assert p.poll() is None, "".join(text)[-4000:]
                return cond()
            return check

        def learner_node() -> int | None:
            return next((i for i, n in enumerate(nodes) if actor_pid(n.pid, "ColocatedWorker")), None)
        wait_for(running(lambda: checkpoints(s3) and learner_node() is not None), "a checkpoint in the bucket",
                 log=lambda: "".join(text))
        lost = learner_node()
        kill_node(nodes[lost].pid)  # the node's every process: a host fault
        wait_for(running(lambda: "resumed from checkpoint: " in "".join(text) and learner_node() == 1 - lost),
                 "the learner on the other node, resumed", log=lambda: "".join(text))
        rc = p.wait(400)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        stop([*nodes, head])
    out = "".join(text)
    assert rc == 0, out[-4000:]
    # the lost learner said by its rank and node, and the checkpoint the job restarts from
    said = re.search(r"tandem: learner rank 0 on node \S+ \((\S+), Ray node [0-9a-f]{12}\) lost \(([^)]*)\); restart 1 of 3 "
                     r"from (\S+)\n", out)
    assert said and said[2] in ("its node died", "its process died", "unreachable: its node or process does not answer") \
        and said[3].startswith(f"{uri}/checkpoints/cycle-"), out[-4000:]
    assert f"resumed from checkpoint: {uri}/checkpoints/cycle-" in out, out[-4000:]
    files = bucket_files(s3, "jobs/run/")
    steps = [json.loads(x)["step"] for x in files["metrics.jsonl"].decode().splitlines()]
    assert steps == list(range(1, 9)), steps  # the lines after the checkpoint resumed from were cut, then trained
    kept = checkpoints(s3)
    assert sorted(kept) == ["cycle-000006", "cycle-000008"], sorted(kept)  # save_total_limit 2, the final one
    assert kept["cycle-000008"]["steps"] == 8
    from tandem.services.orchestrator.controller import parts_state
    from tandem.services.orchestrator.epoch_record import EpochRecord

    trained = EpochRecord(16)  # one bit per row and epoch: a prompt trained twice would have raised
    trained.load(parts_state(kept["cycle-000008"]["controller"], 16)["record"]["trained"])
    assert len(trained.pairs()) == 16  # 2 prompts a step, 8 steps: every row once
    assert "adapter/adapter_config.json" in files and "adapter/adapter_model.safetensors" in files
    assert json.loads(files["adapter/adapter_config.json"])["base_model_name_or_path"] == model_uri
    copies = list((staging / "models").glob("tiny-*/config.json"))  # the head's (the learner nodes' were private)
    assert len(copies) == 1 and (copies[0].parent / "model.safetensors").is_file(), copies
    assert "reward.png" in files and not any(k.startswith((".tandem", "ray_address")) for k in files), sorted(files)
    assert not list(staging.glob("*/rank*")), "a learner's local copy of a checkpoint was left"
    merged = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", "export", uri, "--merged",
                             str(tmp_path / "merged")], env=env, capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr[-3000:]
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "merged" / "model.safetensors"))  # the merged weights, written whole


def checkpoints(s3_env: dict) -> dict:
    """The bucket's complete checkpoints (tandem.json is copied last) -> {name: tandem.json}."""
    return {k.split("/")[0]: json.loads(v)
            for k, v in bucket_files(s3_env, "jobs/run/checkpoints/", "/tandem.json").items()}


def test_a_bucket_this_machine_cannot_write_is_refused_in_one_line(s3, tmp_path, tiny_model):
    """No such bucket, and no credentials at all: `tandem check` and `tandem run` say so, naming the field and the
    URI, before any Ray starts."""
    import yaml

    (tmp_path / "reward.py").write_text(STEADY_REWARD)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1 + 1"}) + "\n")
    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": "data.jsonl"}, "rewards": ["reward.py:r"],
           "logging": {"output_dir": "s3://no-such-bucket/run", "progress": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, **s3, TANDEM_STAGING_DIR=str(tmp_path / "staging"))
    for cmd in ("check", "run"):
        r = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", cmd, "job.yaml"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        said = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(said) == 1, r.stderr[-3000:]
        assert said[0].startswith("tandem: ") and "logging.output_dir = 's3://no-such-bucket/run': this node " \
            "cannot write there (" in said[0] and "bucket does not exist" in said[0], said


def test_a_uri_another_nodes_job_writes_to_is_refused_naming_the_uri_and_that_job(s3, tmp_path, tiny_model):
    """Another node's job holds s3://.../shared (its lease object, written here with boto3, heartbeat 5 s ago):
    `tandem run` into the same URI is refused in one line naming the URI and that job, before any Ray starts
    (the lease's other rules: tests/unit/test_run_lease.py)."""
    import time

    import yaml

    from tandem.core.storage import LEASE

    (tmp_path / "reward.py").write_text(STEADY_REWARD)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1 + 1"}) + "\n")
    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": "data.jsonl"}, "rewards": ["reward.py:r"],
           "logging": {"output_dir": f"s3://{BUCKET}/shared", "progress": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    lease = {"id": "other", "host": "node-b", "pid": 4242, "since": time.time() - 60, "beat": time.time() - 5}
    s3_client(s3).put_object(Bucket=BUCKET, Key=f"shared/{LEASE}", Body=json.dumps(lease).encode())
    env = dict(os.environ, **s3, TANDEM_STAGING_DIR=str(tmp_path / "staging"))
    r = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", "run", "job.yaml"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    said = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(said) == 1, r.stderr[-3000:]
    assert f"logging.output_dir = 's3://{BUCKET}/shared': another job is writing to it (pid 4242 on node-b" in said[0]
    assert not bucket_files(s3, "shared/metrics")  # nothing of this run reached the bucket
