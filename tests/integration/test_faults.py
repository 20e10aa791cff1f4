"""Deaths the job survives without a person, on a real `ray start` cluster: SIGKILL of a rollout worker,
the learner, the controller and the driver, then SIGTERM of `tandem run` during a slow cycle and while it starts; and
errors inside the actors as one line."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tandem.services.devtools.local_nodes import actor_pid
from tandem.services.orchestrator.controller import parts_state
from tandem.services.orchestrator.epoch_record import EpochRecord
from tests.helpers import ROOT, unmapped_semaphores

pytestmark = pytest.mark.integration

SLOW_REWARD = '''
import os, time
def r(completions, **kw):
    if os.path.exists(SLOW):
        time.sleep(40)  # a slow cycle: longer than the bound the interrupt is held to
    return [float(len(c) % 4) for c in completions]
'''


STEADY_REWARD = '''
import time
def r(completions, **kw):
    time.sleep(0.3)  # a step takes a second or so: a kill after the first checkpoint lands mid-run
    return [float(len(c) % 4) for c in completions]
'''


def lines(metrics: Path) -> list[dict]:
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []


def replaced_at(metrics: Path) -> int | None:
    """The first step whose metrics count a replaced rollout worker."""
    return next((x["step"] for x in lines(metrics) if x.get("count/worker_failures", 0) >= 1), None)


def newest_checkpoint_step(run: Path) -> int:
    """The step of the newest checkpoint that finished writing (0: none yet)."""
    best = 0
    for t in run.glob("checkpoints/cycle-*/tandem.json"):
        try:
            if not t.parent.name.endswith(".tmp"):
                best = max(best, json.loads(t.read_text())["steps"])
        except (OSError, ValueError):  # pruned or renamed while read
            pass
    return best


def wait_for(cond, what: str, timeout: float = 240.0, log=None):
    """cond()'s first true value within timeout s; else a failure naming `what`, with the end of log()."""
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f"; the run printed:\n{log()[-4000:]}" if log else ""))


def test_errors_inside_the_actors_reach_the_user_as_one_line(ray_session, tmp_path, tiny_model, capsys,
                                                              monkeypatch):
    """`tandem run` on this machine: a GPU request no node has is refused in one line naming the field
    (rc 2), before any actor waits for it; so is a model directory without tokenizer files (found by the controller's
    setup); a run-time error inside the actors (a weights file cut short) is one line with rc 1, its whole traceback
    in <output_dir>/error.log."""
    import shutil

    import yaml

    from tandem.services.app.cli import main
    from tandem.services.app.supervisor import SUPERVISED

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

    bare = tmp_path / "bare"  # weights and config, but no tokenizer: refused inside the controller's setup
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model) / f, bare / f)
    job.write_text(yaml.safe_dump({**base, "model": {**base["model"], "path": str(bare)}}))
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model.path {str(bare)!r}: no tokenizer could be loaded" in err, err
    cut = tmp_path / "cut"  # a model whose weights file was cut short: a run-time error inside the actors
    shutil.copytree(tiny_model, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    job.write_text(yaml.safe_dump({**base, "model": {**base["model"], "path": str(cut)}}))
    assert main(["run", str(job)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tandem: ") and "Traceback" not in err, err
    log = tmp_path / "run" / "error.log"
    assert f"(traceback: {log})" in err and "Traceback" in log.read_text()


def start_cluster_run(ray_head, tmp_path: Path, tiny_model: str, reward: str, max_steps: int, cluster: dict):
    """`tandem run --address` on the token-auth `ray start` head, as the README runs it: 16 prompts, 4
    completions each, a checkpoint every 2 steps, the reward `reward.py:r` of source `reward`. -> the process,
    stdout and stderr in one pipe."""
    import subprocess
    import sys

    import yaml

    (tmp_path / "reward.py").write_text(reward)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(16)))
    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": "data.jsonl"}, "rewards": ["reward.py:r"],  # relative, as in the README
           "generation": {"max_prompt_length": 64, "max_completion_length": 8},
           "batch": {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": max_steps},
           "optimizer": {"learning_rate": 1e-2}, "cluster": cluster,
           "checkpoint": {"save_steps": 2, "save_total_limit": None},
           "logging": {"output_dir": "run", "progress": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return subprocess.Popen([sys.executable, "-m", "tandem.services.app.cli", "run", "job.yaml", "--address",
                             ray_head["gcs"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, env=cluster_env(ray_head))


def cluster_env(ray_head) -> dict:
    """This machine's environment holding the head's token, and nothing else of auth."""
    env = dict(os.environ, RAY_AUTH_TOKEN=ray_head["token"])
    env.pop("RAY_AUTH_MODE", None)
    return env


def test_every_death_on_a_ray_start_cluster_is_survived_and_sigterm_saves_within_seconds(ray_head, tmp_path,
                                                                                       tiny_model):
    """`tandem run --address` on a token-auth `ray start` head, as the README runs it. SIGKILL of the rollout
    worker (replaced), of the learner and of the controller (each: the job restarts from its newest
    checkpoint), of the driver (`tandem run` starts it again); then, during a cycle whose reward takes
    40 s, `tandem status --address` (answered) and SIGTERM (a checkpoint within seconds, rc 130). One
    metrics line per step; no prompt trained twice."""
    import subprocess
    import sys

    left_before = unmapped_semaphores()
    slow = tmp_path / "slow"
    p = start_cluster_run(ray_head, tmp_path, tiny_model, f"SLOW = {str(slow)!r}\n" + SLOW_REWARD, max_steps=60,
                          cluster={"max_restarts": 2})
    metrics = tmp_path / "run" / "metrics.jsonl"
    text: list[str] = []
    threading.Thread(target=lambda: text.extend(p.stdout), daemon=True).start()

    def said(what: str) -> bool:
        return what in "".join(text)

    def resumed() -> int:  # restarts whose new controller has resumed and cut the rolled-back metrics lines
        return "".join(text).count("resumed from checkpoint: ")

    def wait(cond, what: str):  # with what `tandem run` printed; failing at once if it ended first
        def check():
            if p.poll() is not None:
                raise AssertionError(f"tandem run ended (rc {p.returncode}) before {what}:\n{''.join(text)[-4000:]}")
            return cond()
        return wait_for(check, what, log=lambda: "".join(text))

    def kill(cls: str) -> None:
        pid = wait(lambda: actor_pid(ray_head["pid"], cls), f"a {cls} process")
        os.kill(pid, signal.SIGKILL)

    def driver() -> int | None:  # the supervisor's child
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        return int(kids[0]) if kids else None
    try:
        wait(lambda: len(lines(metrics)) >= 2, "step 2")
        kill("RolloutWorker")
        # the replacement is on record in a checkpoint, so the learner's death below cannot roll it back
        wait(lambda: len(lines(metrics)) >= 4 and (s := replaced_at(metrics)) is not None
                 and newest_checkpoint_step(tmp_path / "run") >= s, "a checkpoint after the worker's replacement")
        kill("Learner")
        # after the resume: before it, the old controller is still shutting down, and lines past the checkpoint remain
        wait(lambda: said("tandem: learner rank 0 on node ") and said("; restart 1 of 2 from ") and resumed() >= 1
             and len(lines(metrics)) >= 6,
             "step 6 after the learner's death")
        kill("Controller")
        wait(lambda: said("tandem: the controller actor lost (") and said("restart 2 of 2") and resumed() >= 2
             and len(lines(metrics)) >= 8,
             "step 8 after the controller's death")
        first = driver()
        os.kill(first, signal.SIGKILL)
        wait(lambda: said("the driver died of SIGKILL") and driver() not in (None, first) and resumed() >= 3
             and len(lines(metrics)) >= 10, "step 10 after the driver's death")
        slow.write_text("")
        time.sleep(2.0)  # the next cycle's groups are being scored slowly now
        st = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", "status", "job.yaml", "--address",
                             ray_head["gcs"]], capture_output=True, text=True, cwd=tmp_path, env=cluster_env(ray_head),
                            timeout=60)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(120)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)
    out = "".join(text)
    assert rc == 130, out[-4000:]
    # `tandem status` reached the job through the token-auth head mid-cycle (the controller's second thread)
    assert st.returncode == 0 and "rollout workers 1 (target 1; " in st.stdout, st.stdout + st.stderr
    assert took < 25, f"SIGTERM took {took:.0f} s"
    assert "the driver died of SIGKILL; restart 1 of 2 from the newest checkpoint" in out
    assert out.count("resumed from checkpoint: ") >= 3 and "interrupted: saving a checkpoint" in out
    steps = [x["step"] for x in lines(metrics)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 10, steps  # rolled-back lines were cut
    assert any(x.get("count/worker_failures", 0) >= 1 for x in lines(metrics))  # the worker was replaced
    ck = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    meta = json.loads((ck / "tandem.json").read_text())
    assert meta["steps"] == len(steps)  # the SIGTERM checkpoint holds every step logged
    st = parts_state(meta["controller"], 16)  # the controller's state by part
    trained = EpochRecord(16)
    trained.load(st["record"]["trained"])  # one bit per row and epoch: trained twice would have raised
    assert len(trained) == len(trained.pairs()) == 2 * len(steps)
    pending = {tuple(x) for x in st["source"]["requeued"]}
    assert pending and not pending & {(i, e) for e, i in trained.pairs()}  # the slow cycle's prompts come back
    # no process of the job (its killed actors' included) left a semaphore behind
    assert wait_for(lambda: unmapped_semaphores() <= left_before, "the job's semaphores released", timeout=30)


def test_sigterm_while_the_job_starts_ends_it_in_one_line(ray_head, tmp_path, tiny_model):
    """SIGTERM (or Ctrl-C) before the first step, here while the controller waits for a node that has the
    rollout worker's resource: `tandem run` stops at once with rc 130 and a line saying nothing was trained,
    no traceback."""
    left_before = unmapped_semaphores()
    p = start_cluster_run(ray_head, tmp_path, tiny_model, STEADY_REWARD, max_steps=8,
                          cluster={"rollout_resources": {"num_cpus": 1, "resources": {"absent": 1}}})
    try:
        wait_for(lambda: p.poll() is not None or actor_pid(ray_head["pid"], "Controller"), "the controller")
        time.sleep(2.0)  # in its wait for a node
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, out[-4000:]
    assert "interrupted while starting: no step trained since the newest checkpoint; stopping" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert wait_for(lambda: unmapped_semaphores() <= left_before, "the job's semaphores released", timeout=30)
