"""What `tandem run` refuses or reports, on the embedded Ray, each as one true line: checkpoints
it cannot resume from, a run with nothing to train on, a run directory it cannot write or that a running job
holds, an actor's error that does not unpickle, a resource no node has, a metrics line a crash cut; and no
semaphore or scratch directory left in /dev/shm after a run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tandem.services.app.cli import main
from tandem.services.app.supervisor import SUPERVISED
from tests.helpers import ROOT

pytestmark = pytest.mark.integration


class Payload:
    """A pickle whose loading would create `marker` (it must never run)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def write_job(tmp_path: Path, tiny_model: str, reward: str = f"{ROOT}/examples/rewards.py:digits_reward",
              rows: int = 8, **sections) -> Path:
    """A job file of the tiny model: `rows` prompts, 4 completions each, one optimizer step a cycle."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a} + {a}"}) + "\n" for a in range(rows)))
    job = {"model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
           "data": {"path": str(data)}, "rewards": [reward],
           "generation": {"max_prompt_length": 64, "max_completion_length": 8},
           "batch": {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 2},
           "cluster": {"max_restarts": 0},
           "logging": {"output_dir": str(tmp_path / "run"), "progress": False}}
    for k, v in sections.items():
        job.setdefault(k, {}).update(v)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run(capsys, job: Path, *sets: str) -> tuple[int, str, str]:
    rc = main(["run", str(job), *(x for s in sets for x in ("--set", s))])
    got = capsys.readouterr()
    return rc, got.out, got.err


def metrics_steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.alone  # what it finds in /dev/shm is every process's: no other test beside it
def test_skipped_checkpoints_are_named_and_kept_and_none_readable_refuses_the_run(ray_session, tmp_path, tiny_model,
                                                                                 capsys, monkeypatch):
    """The newest checkpoint holds a planted pickle: the resume names it with why, sets it aside as
    cycle-000003.refused (retention and the save of cycle 3 again leave it), resumes from cycle 2; a metrics line a
    crash cut is named and the summary still counts every step trained. Then every checkpoint unreadable (bad JSON,
    a truncated state file, a missing one): refused in one line naming each, nothing trained, nothing cut."""
    monkeypatch.setenv(SUPERVISED, "1")  # the driver in this process, on the session's Ray
    shm_before = shm_entries()
    # the checkpoints' handling is the subject, not the engine: transformers samples (no vLLM to import per run)
    job = write_job(tmp_path, tiny_model, batch={"max_steps": 3}, checkpoint={"save_steps": 1, "save_total_limit": 2},
                    model={"fast_inference": False})
    rc, out, err = run(capsys, job)
    assert rc == 0, err
    cks = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in cks.iterdir()) == ["cycle-000002", "cycle-000003"]
    state = next((cks / "cycle-000003" / "state").rglob("mp_rank_00_model_states.pt"))
    marker = tmp_path / "ran"
    torch.save({"module": Payload(marker)}, state)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    cut = lines[1][:lines[1].index('"step": 2,') + 12]  # step 2's line cut by a crash
    metrics.write_text("\n".join([lines[0], cut, lines[2]]) + "\n")

    rc, out, err = run(capsys, job, "checkpoint.resume=true", "batch.max_steps=5")
    assert rc == 0, err
    assert "tandem: checkpoint cycle-000003 skipped: failed to load: " in out and str(state) in out, out
    assert "; kept as cycle-000003.refused" in out and f"resumed from checkpoint: {cks / 'cycle-000002'}" in out
    assert "line 2 was cut short (a crash while writing it) and is dropped" in out, out
    assert "step 2 was trained and keeps no metrics line" in out
    assert "steps: 5 (1 without a metrics line: named above)" in out, out
    assert not marker.exists(), "the planted pickle ran"
    assert sorted(p.name for p in cks.iterdir()) == ["cycle-000003.refused", "cycle-000004", "cycle-000005"]
    assert (cks / "cycle-000003.refused" / state.relative_to(cks / "cycle-000003")).is_file()
    assert metrics_steps(metrics) == [1, 3, 4, 5]

    (cks / "cycle-000005" / "tandem.json").write_text('{"version": 5, "ste')  # cut
    cut_state = next((cks / "cycle-000004" / "state").rglob("mp_rank_00_model_states.pt"))
    cut_state.write_bytes(cut_state.read_bytes()[:100])  # truncated
    rc, out, err = run(capsys, job, "checkpoint.resume=true", "batch.max_steps=6")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"tandem: checkpoint.resume: no checkpoint in {cks} can be resumed from: cycle-000005 ("), err
    assert f"cycle-000004 ({cut_state}: cut short" in err and "Traceback" not in err + out  # before any actor
    assert metrics_steps(metrics) == [1, 3, 4, 5], "a refused resume cut the record"
    assert sorted(p.name for p in cks.iterdir()) == ["cycle-000003.refused", "cycle-000004", "cycle-000005"]
    (cks / "cycle-000004" / "rng_rank0.safetensors").unlink()  # a part missing
    rc, _, err = run(capsys, job, "checkpoint.resume=true", "batch.max_steps=6")
    assert rc == 2 and "cycle-000005 (" in err and "cycle-000004/rng_rank0.safetensors: missing)" in err, err
    assert not shm_entries() - shm_before, sorted(shm_entries() - shm_before)  # five runs: nothing left behind


NONE_FOR_ROW_1 = '''
def r(prompts, completions, **kw):
    return [None if p.startswith("1 ") else float(len(c) % 3) for p, c in zip(prompts, completions)]
'''

NONE_ALWAYS = '''
def none(completions, **kw):
    return [None] * len(completions)
'''


def test_a_group_without_any_reward_is_recorded_not_trained_and_a_cycle_of_them_stops_the_run(
        ray_session, tmp_path, tiny_model, capsys, monkeypatch):
    monkeypatch.setenv(SUPERVISED, "1")
    (tmp_path / "rew.py").write_text(NONE_FOR_ROW_1 + NONE_ALWAYS)
    job = write_job(tmp_path, tiny_model, reward=f"{tmp_path / 'rew.py'}:r", batch={"max_steps": 4},
                    model={"fast_inference": False})  # the rewards are the subject: transformers samples
    rc, out, err = run(capsys, job)
    assert rc == 0, err
    failed = [json.loads(x) for x in (tmp_path / "run" / "failed_prompts.jsonl").read_text().splitlines()]
    assert failed and {f["index"] for f in failed} == {1} and {f["reason"] for f in failed} == {"no_reward"}
    assert "returned None for all 4 completions of dataset row 1: not trained on" in failed[0]["message"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["count/groups_no_reward"] == len(failed)

    job = write_job(tmp_path, tiny_model, reward=f"{tmp_path / 'rew.py'}:none",
                    logging={"output_dir": str(tmp_path / "run2")}, model={"fast_inference": False})
    rc, out, err = run(capsys, job)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"tandem: rewards = ['{tmp_path / 'rew.py'}:none']: returned None for every completion of "
                          "the last 2 prompts, a whole generation cycle: nothing to train on"), err
    assert not (tmp_path / "run2" / "metrics.jsonl").exists() or not metrics_steps(tmp_path / "run2" / "metrics.jsonl")


def test_each_refusal_is_one_true_line(ray_session, tmp_path, tiny_model, capsys, monkeypatch):
    """A bad lora.target_modules (peft's error does not unpickle: Ray said "Failed to deserialize exception"), a run
    directory that cannot be written, one a running job holds: one line each, naming the field and what is allowed,
    and no actor left behind."""
    monkeypatch.setenv(SUPERVISED, "1")
    job = write_job(tmp_path, tiny_model, model={"lora": {"r": 8, "lora_alpha": 16, "target_modules": ["foo_proj"]}})
    rc, _, err = run(capsys, job)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("tandem: model.lora.target_modules = ['foo_proj']: Target modules {'foo_proj'} not found"), err
    assert "allowed: names of" in err and "'q_proj'" in err
    assert not ray_session.util.list_named_actors(all_namespaces=True), "a refused job left an actor behind"

    job = write_job(tmp_path, tiny_model)
    ro = "/sys/tandem-run"  # root writes anywhere but a read-only filesystem
    t0 = time.time()
    rc, out, err = run(capsys, job, f"logging.output_dir={ro}")
    assert rc == 2 and len((out + err).strip().splitlines()) == 1, out + err
    assert err.strip().startswith(f"tandem: logging.output_dir = '{ro}': cannot write in '/sys' (") and \
        "allowed: a directory this user can create and write" in err and time.time() - t0 < 5

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom tandem.services.app.run import hold_run_dir\n"
                               f"with hold_run_dir({str(tmp_path / 'run')!r}):\n    print('held', flush=True)\n"
                               "    time.sleep(120)"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _, err = run(capsys, job)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"tandem: logging.output_dir = '{tmp_path / 'run'}': a job is already running in it (pid "
                          f"{holder.pid} on "), err


def test_a_wait_for_resources_says_what_it_waits_for(ray_session, tmp_path, tiny_model, monkeypatch, capsys):
    """While the controller's setup waits for a node that can hold a request, the driver prints what it waits
    for every WAIT_REPORT_S (10 s; 0.5 here)."""
    import io

    from tandem.core.config import JobConfig
    from tandem.services.app import run as run_module

    monkeypatch.setattr(run_module, "WAIT_REPORT_S", 0.5)
    cfg = JobConfig.from_yaml(write_job(tmp_path, tiny_model, cluster={"rollout_resources": {"num_gpus": 1}}))
    setup = ray_session.remote(lambda: time.sleep(1.7)).remote()  # the setup, still waiting
    out = io.StringIO()
    run_module.wait_reporting(ray_session, cfg, setup, 60, out)
    said = out.getvalue().splitlines()
    assert len(said) >= 2 and all(s.startswith("tandem: waiting for a node (") for s in said), said
    assert "s of 60): cluster.rollout_resources = {'CPU': 1.0, 'GPU': 1.0}: no node" in said[0], said


def shm_entries() -> set[str]:
    """What Tandem's processes may leave in /dev/shm: multiprocessing's semaphores, the engine's adapter dirs."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith(("sem.mp-", "tandem-"))} if shm.is_dir() else set()


@pytest.mark.alone  # what it finds in /dev/shm is every process's: no other test beside it
def test_no_semaphore_or_scratch_dir_is_left_in_dev_shm(tmp_path, tiny_model):
    """`tandem run` as a user runs it (its own embedded Ray), a job whose learner fails after the rollout workers
    started: nothing is left in /dev/shm. The runs that train: the checkpoint test above."""
    before = shm_entries()
    job = write_job(tmp_path, tiny_model, model={"lora": {"r": 8, "lora_alpha": 16, "target_modules": ["foo_proj"]}})
    p = subprocess.run([sys.executable, "-m", "tandem.services.app.cli", "run", str(job)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Token authentication" not in p.stderr + p.stdout  # its Ray has token auth on, and does not ask to turn it off
    time.sleep(1)
    assert not shm_entries() - before, sorted(shm_entries() - before)
