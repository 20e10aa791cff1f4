"""`tandem submit`: a job through a real Ray cluster's Jobs API (a head with its dashboard started
here), run to the end, its metrics written."""

import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.helpers.credentials import CREDENTIALS, SECRET_CONTENT, write_tree

pytestmark = pytest.mark.integration

def scrape(port: int) -> dict:
    """The ray_tandem_* series of Ray's Prometheus export endpoint: {name: value} (one job: one value)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    series = (re.match(r"(ray_tandem_\w+)(?:\{[^}]*\})?\s+(\S+)", ln) for ln in text.splitlines())
    return {m.group(1): float(m.group(2)) for m in series if m}


def test_submit_runs_the_job_on_the_cluster(ray_head, tmp_path, tiny_model, capsys, monkeypatch):
    """Submitted with the token, only what the job names uploaded (every credential kind of the probes beside it,
    none sent) and listed, and exactly that arrives on the head; while it runs, the dashboard's metrics endpoint
    exports the values metrics.jsonl records."""
    import threading

    from tandem.services.app.cli import main
    from tandem.services.app.run import answered_within

    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head["token"])  # what this machine holds, nothing else
    metrics_port = ray_head["metrics_port"]
    snapshots, done = [], threading.Event()

    def watch():
        while not done.is_set():
            try:
                if got := scrape(metrics_port):
                    snapshots.append(got)
            except OSError:
                pass
            time.sleep(0.3)
    threading.Thread(target=watch, daemon=True).start()

    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(8)))
    out = tmp_path / "run"
    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": "data.jsonl"},  # relative: the uploaded working directory is the job's
           "rewards": [f"{ROOT}/examples/rewards.py:digits_reward"],
           "generation": {"max_prompt_length": 64, "max_completion_length": 8},
           "batch": {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 4},
           "logging": {"output_dir": str(out), "progress": False}}
    (wd / "job.yaml").write_text(yaml.safe_dump(job))
    (wd / ".env").write_text("SECRET=1\n")  # never leaves this machine
    (wd / ".git").mkdir()
    (wd / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    write_tree(wd, {**CREDENTIALS, **SECRET_CONTENT})  # every credential kind a probe found on a head
    os.chdir(wd)  # the job file and its data as a user would have them (pytest restores nothing: go back)
    try:
        rc = answered_within(lambda: main(["submit", "job.yaml", "--address", ray_head["url"], "--wait", "--set",
                                           "optimizer.learning_rate=0.01", "--set",
                                           "optimizer.lr_scheduler_type=constant"]), 600)  # fail, never hang
    finally:
        os.chdir(ROOT)
        done.set()
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert "submitted tandem-" in printed and "SUCCEEDED" in printed and "reward: first" in printed
    assert "uploading what the job names from" in printed and ": 2 files" in printed, printed[:500]
    sent = [ln[4:] for ln in printed.splitlines() if ln.startswith("  + ")]
    assert sent == ["job.yaml (the job file)", "data.jsonl (data.path)"], printed[:3000]
    # what arrived on the head: the job's working directory as Ray unpacked it there
    arrived = {str(p.relative_to(d)) for d in Path(ray_head["temp"]).glob("session_*/runtime_resources/"
                                                                           "working_dir_files/*/")
               for p in d.rglob("*") if p.is_file()}
    assert arrived == {"data.jsonl", "job.yaml"}, arrived
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["lr"] == 0.01 for r in rows)
    # what the run records names the user's files as their machine has them, not Ray's copy on the head
    (final,) = sorted((out / "checkpoints").glob("cycle-*"))[-1:]
    recorded = json.loads((final / "tandem.json").read_text())["controller"]["fingerprint"]["data.path"]
    assert recorded == str(wd / "data.jsonl"), recorded
    # the dashboard's series carry the record's values: a snapshot of each step's version holds its reward
    by_version = {r["version"]: r for r in rows}
    matched = [s for s in snapshots if s.get("ray_tandem_version") in by_version]
    assert matched, f"no ray_tandem_* snapshot of a logged step among {len(snapshots)}: {snapshots[-1:]}"
    for s in matched:
        r = by_version[s["ray_tandem_version"]]
        assert s["ray_tandem_reward"] == pytest.approx(r["reward"], rel=1e-6, abs=1e-9)
        assert s["ray_tandem_loss"] == pytest.approx(r["loss"], rel=1e-6, abs=1e-9)


def test_submit_refuses_a_bad_job_file_before_the_cluster(tmp_path, capsys):
    from tandem.services.app.cli import main

    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model": {"path": str(tmp_path)}, "data": {"path": "x"},
                                                       "rewards": ["r.py:f"], "batch": {"num_generations": 1}}))
    assert main(["submit", str(tmp_path / "job.yaml"), "--address", "http://127.0.0.1:9"]) == 2
    assert "num_generations" in capsys.readouterr().err


def test_a_wrong_token_is_named_as_such_within_seconds(ray_head, tmp_path, monkeypatch):
    """`tandem status` and `tandem scale --address` against the token-auth head holding another token, or none: one
    line saying the cluster refused the token, in seconds."""
    import subprocess
    import sys

    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                                                       "rewards": ["r.py:f"], "cluster": {"max_restarts": 0},
                                                       "logging": {"output_dir": str(tmp_path / "run")}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    for token, said in (("0" * 64, "refused this machine's token"), (None, "needs a token and this machine holds none")):
        for cmd in (["status", "job.yaml"], ["scale", "job.yaml", "2"]):
            t0 = time.time()
            p = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", *cmd, "--address", ray_head["gcs"]],
                               capture_output=True, text=True, cwd=tmp_path, timeout=120,
                               env={**env, "HOME": str(tmp_path), **({"RAY_AUTH_TOKEN": token} if token else {})})
            err = p.stderr.strip()
            assert p.returncode == 2 and len(err.splitlines()) == 1, (cmd, err[-2000:])
            assert err.startswith(f"tandem: the Ray cluster at {ray_head['gcs']} {said} (InvalidAuthToken"), (cmd, err)
            assert time.time() - t0 < 15, (cmd, time.time() - t0)


def test_a_detached_submission_says_the_clusters_refusal_and_fails(ray_head, tmp_path, tiny_model, capsys,
                                                                   monkeypatch):
    """Without --wait, `tandem submit` follows the job until it trains or fails: a run directory the cluster cannot
    write (checked there, not here) is said with the job's own reason, rc 1, within seconds of the refusal."""
    from tandem.services.app.cli import main

    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head["token"])
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1 + 1"}) + "\n")
    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": str(tmp_path / "data.jsonl")}, "rewards": [f"{ROOT}/examples/rewards.py:digits_reward"],
           "logging": {"output_dir": "/proc/tandem-no-such-run", "progress": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    rc = main(["submit", str(tmp_path / "job.yaml"), "--working-dir", "", "--address", ray_head["url"]])
    captured = capsys.readouterr()
    assert rc == 1, captured.out[-2000:] + captured.err[-2000:]
    said = captured.err.strip().splitlines()[-1]
    assert said.startswith("job tandem-") and ": FAILED: tandem: logging.output_dir = '/proc/tandem-no-such-run'" \
        in said, said
