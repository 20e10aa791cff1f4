"""Run directories that never mix and input refused early: checkpoint fingerprints, unreadable
checkpoints skipped, metrics cut back on resume, RNG states that load without unpickling, SIGTERM
taking Ctrl-C's path, .json data and reward weights checked at load."""

import json
import os
import pickle
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tandem.core.config import JobConfig, JobConfigError
from tandem.learner.checkpoint_io import load_rng, save_rng
from tandem.services.app.run import sigterm_as_interrupt
from tandem.services.devtools.tiny_model import build_tokenizer
from tandem.services.orchestrator.checkpointer import Checkpointer, fingerprint, fingerprint_changes
from tandem.services.orchestrator.data import DataError, load_rows
from tandem.services.orchestrator.run_log import RunLog
from tests.helpers.credentials import CREDENTIALS, PRIVATE_KEY, SECRET_CONTENT, write_tree


def cfg_of(job_files, **sections):
    return JobConfig.from_dict({**job_files, **sections})


def test_fingerprint_changes_with_what_decides_training_and_not_with_what_may_change(job_files, tmp_path):
    base = fingerprint(cfg_of(job_files), 8)
    same = [cfg_of(job_files, batch={"max_steps": 99}), cfg_of(job_files, cluster={"num_rollout_workers": 3}),
            cfg_of(job_files, logging={"progress": False}), cfg_of(job_files, checkpoint={"resume": True})]
    assert all(fingerprint(c, 8) == base for c in same)
    changed = {
        "data order": cfg_of(job_files, seed=7),
        "job": cfg_of(job_files, optimizer={"learning_rate": 1e-3}),
    }
    for key, c in changed.items():
        diff = fingerprint_changes(base, fingerprint(c, 8))
        assert [d.split(" (")[0] for d in diff] == [key], diff
    assert fingerprint_changes(base, fingerprint(cfg_of(job_files), 9)) == ["data rows (8 -> 9)"]
    with open(job_files["data"]["path"], "a") as f:
        f.write(json.dumps({"prompt": "new", "answer": 0}) + "\n")
    assert "data content" in fingerprint_changes(base, fingerprint(cfg_of(job_files), 8))[0]


META = {"version": 1, "steps": 2, "controller": {p: {} for p in ("source", "progress", "record", "buffer", "failures",
                                                                 "counters", "fingerprint")}}


@pytest.mark.parametrize("edit,said", [
    (lambda m: m.update(steps="2"), "steps is '2' (str); expected a whole number >= 0"),
    (lambda m: m.update(version=-1), "version is -1 (int); expected a whole number >= 0"),
    (lambda m: m.update(controller=[]), "controller is [] (list); expected an object"),
    (lambda m: m["controller"].update(source=[1, 2]), "controller.source is [1, 2] (list); expected an object"),
    (lambda m: m["controller"].pop("counters"), "controller.counters is None (NoneType); expected an object"),
])
def test_a_hand_edited_tandem_json_with_wrong_types_is_named_with_its_file_and_field(job_files, tmp_path, edit, said):
    """Not a bare TypeError from deep in the resume: the checkpoint is refused as unreadable, naming the file and
    the field (an older checkpoint is used where there is one; none left refuses the run, naming each)."""
    root = tmp_path / "ck"
    cfg = cfg_of(job_files, checkpoint={"dir": str(root)})
    (root / "cycle-000002" / "state").mkdir(parents=True)
    (root / "cycle-000002" / "rng_rank0.safetensors").write_bytes(b"x")
    meta = json.loads(json.dumps(META))
    edit(meta)
    (root / "cycle-000002" / "tandem.json").write_text(json.dumps(meta))
    with pytest.raises(JobConfigError) as e:
        Checkpointer(cfg).refuse_if_none_readable()
    assert f"cycle-000002 ({root / 'cycle-000002' / 'tandem.json'}: {said})" in str(e.value), str(e.value)


def test_an_unreadable_newest_checkpoint_is_named_and_an_older_one_used(job_files, tmp_path):
    root = tmp_path / "ck"
    cfg = cfg_of(job_files, checkpoint={"dir": str(root)})
    for name in ("cycle-000002", "cycle-000004", "cycle-000006"):
        (root / name / "state").mkdir(parents=True)
        (root / name / "tandem.json").write_text(json.dumps(META))
        (root / name / "rng_rank0.safetensors").write_bytes(b"x")
    (root / "cycle-000006" / "tandem.json").write_text('{"version": 6, "ste')  # cut by a crash
    (root / "cycle-000004" / "rng_rank0.safetensors").unlink()
    assert Checkpointer(cfg).latest() == str(root / "cycle-000002")
    out = " ".join(f"{ck.name}: {why}" for ck, why in Checkpointer(cfg).candidates())  # the resume prints these
    assert "cycle-000006/tandem.json" in out and "cycle-000004/rng_rank0.safetensors: missing" in out
    aside = Checkpointer.set_aside(root / "cycle-000006")  # out of retention's and the next save's way
    assert aside.name == "cycle-000006.refused" and Checkpointer(cfg).candidates()[0][0].name == "cycle-000004"
    (root / "cycle-000006").mkdir()
    assert Checkpointer.set_aside(root / "cycle-000006").name == "cycle-000006.refused-2"


def test_a_state_file_cut_short_is_unreadable_and_none_readable_refuses_before_anything_starts(job_files, tmp_path):
    root = tmp_path / "ck"
    cfg = cfg_of(job_files, checkpoint={"dir": str(root)})
    for name in ("cycle-000002", "cycle-000004"):
        (root / name / "state" / "global_step2").mkdir(parents=True)
        (root / name / "tandem.json").write_text(json.dumps(META))
        (root / name / "rng_rank0.safetensors").write_bytes(b"x")
        torch.save({"module": {"w": torch.ones(64)}}, root / name / "state" / "global_step2" / "mp_rank_00_model_states.pt")
    Checkpointer(cfg).refuse_if_none_readable()  # both intact: nothing to refuse
    cut = root / "cycle-000004" / "state" / "global_step2" / "mp_rank_00_model_states.pt"
    cut.write_bytes(cut.read_bytes()[:200])
    assert Checkpointer(cfg).latest() == str(root / "cycle-000002")
    Checkpointer(cfg).refuse_if_none_readable()  # an older one still looks readable: the resume will try it
    (root / "cycle-000002" / "tandem.json").write_text('{"version": 2, "ste')
    with pytest.raises(JobConfigError) as e:
        Checkpointer(cfg).refuse_if_none_readable()
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.resume: no checkpoint in {root} can be resumed from: cycle-000004 ({cut}: cut "
                          "short or not written by torch.save"), msg
    assert "cycle-000002 (" in msg and "allowed: repair or remove them" in msg
    Checkpointer(cfg_of(job_files, checkpoint={"dir": str(tmp_path / "none")})) \
        .refuse_if_none_readable()  # no checkpoint at all: a fresh start, nothing refused


def test_resume_cuts_metrics_back_to_the_checkpoint_and_drops_a_cut_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "reward": 0.1}) + "\n" for s in range(1, 7)) + '{"step": 7, "re')
    log = RunLog(p)
    assert log.cut_back(4) == 3
    assert len(log.cut) == 1 and "metrics.jsonl line 7 was cut short" in log.cut[0], log.cut
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3, 4]
    p.write_text(p.read_text() + '{"step": 5, "re\n{"step": 6, "reward": 0.1}\n')  # a line cut, then a resume at 6
    assert log.cut_back(6) == 1 and "step 5 was trained and keeps no metrics line" in log.cut[0], log.cut


def test_rng_states_round_trip_and_a_planted_pickle_is_refused_without_running(tmp_path):
    path = tmp_path / "rng_rank0.safetensors"
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # a cached gaussian is part of numpy's state
    save_rng(path)
    want = (random.random(), np.random.rand(), torch.rand(1).item(), np.random.normal())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    load_rng(path)
    assert (random.random(), np.random.rand(), torch.rand(1).item(), np.random.normal()) == want

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    path.write_bytes(pickle.dumps(Payload()))
    from tandem.learner.safe_load import CheckpointRefused

    with pytest.raises(CheckpointRefused, match=f"checkpoint file {re.escape(str(path))}: not a safetensors file"):
        load_rng(path)
    assert not marker.exists()  # no code ran


def test_sigterm_takes_the_path_of_ctrl_c():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs at the next bytecode boundary
                pass
    assert signal.getsignal(signal.SIGTERM) is before  # restored after the run


@pytest.mark.parametrize("content, message", [
    ({"prompt": "hello"}, "column 'prompt' is a str, not a list"),
    ({"prompt": ["a", "b", "c"], "answer": [1, 2]}, r"columns of unequal length \{'prompt': 3, 'answer': 2\}"),
    ("just text", "a JSON str at the top"),
])
def test_json_data_that_is_not_rows_or_equal_columns_is_refused(tmp_path, content, message):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(content))
    with pytest.raises(DataError, match=message):
        load_rows(str(p))
    p.write_text(json.dumps({"prompt": ["a", "b"], "answer": [1, 2]}))
    assert load_rows(str(p)) == [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]


def test_non_utf8_data_names_the_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d.jsonl: not UTF-8 text \(byte 15"):
        load_rows(str(p))


def test_a_nan_reward_weight_is_refused(job_files):
    with pytest.raises(JobConfigError, match=r"grpo.reward_weights = \[nan\]: every weight must be a finite number"):
        cfg_of(job_files, grpo={"reward_weights": [float("nan")]})


def test_submit_uploads_what_ray_would_minus_secrets_and_history(tmp_path):
    """The list `tandem submit` prints is Ray's packaging walk of the working directory: .gitignore and
    .rayignore honoured, and .env files, .git and keys never uploaded even when nothing ignores them."""
    from tandem.services.app.upload import plan_upload

    for rel, text in {"job.yaml": "a: 1\n", "data/train.jsonl": "{}\n", "rewards.py": "x = 1\n", ".env": "KEY=1\n",
                      ".env.local": "KEY=2\n", "sub/.env": "KEY=3\n", ".git/config": "[core]\n", "id_rsa": "k",
                      "big.bin": "0" * 10, "scratch/tmp.txt": "t", ".gitignore": "big.bin\n", ".rayignore": "scratch/\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = dict(plan_upload(str(tmp_path)).sent)
    assert set(got) == {"job.yaml", "data/train.jsonl", "rewards.py", ".gitignore", ".rayignore"}, got
    assert got["job.yaml"] == 5


def test_submit_of_a_whole_directory_holds_back_every_credential_by_name_or_content_and_names_each(tmp_path, capsys):
    """--working-dir DIR: every credential file of the probes is held back with its reason (a name rule, what
    detect-secrets or our rules found, in UTF-16/32 text too), a name ending in a space or holding a backslash
    included; binaries are listed as unscanned; --dry-run contacts no cluster (the address is a closed port)."""
    from tandem.services.app.cli import main

    write_tree(tmp_path, {**CREDENTIALS, **SECRET_CONTENT, "data.jsonl": '{"prompt": "1 + 1"}\n',
                          "rewards.py": "def r(completions, **kw):\n    return [1.0] * len(completions)\n",
                          "weights.bin": bytes(range(256)) * 4})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"path": "data.jsonl"},
                                                      "rewards": ["rewards.py:r"],
                                                      "logging": {"output_dir": "/srv/runs/a"}}))
    rc = main(["submit", str(tmp_path / "job.yaml"), "--working-dir", str(tmp_path), "--dry-run",
               "--address", "http://127.0.0.1:9"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"uploading the whole directory from {tmp_path}: 4 files" in out, out
    sent = [ln[4:] for ln in out.splitlines() if ln.startswith("  + ")]
    assert sent == ["data.jsonl", "job.yaml", "rewards.py", "weights.bin"], out
    held = dict(ln[4:].split(": ", 1) for ln in out.splitlines() if ln.startswith("  - "))
    shown = {repr(p) if p != p.strip() else p for p in {**CREDENTIALS, **SECRET_CONTENT}}
    assert set(held) == shown, set(held) ^ shown
    assert "by its name" in held["server.key"] and "SSH key" in held[".ssh/known_hosts"]
    assert "by its name" in held[".cache/huggingface/token"] and "by its name" in held[".dockercfg"]
    assert "AWS Access Key on line 1" in held["settings.py"] and "Private Key on line 1" in held["notes/deploy.txt"]
    assert "Hugging Face token on line 1" in held["scripts/train.sh"] and "secret assigned" in held["launch.sh"]
    assert "docker registry auth" in held["registry.json"]
    assert "private key on line 1" in held["notes/utf16.txt"] and "private key on line 1" in held["notes/utf32be.txt"]
    assert "private key" in held["'notes/trailing space.txt '"] and "private key" in held["notes/back\\slash.txt"]
    assert "Secret Keyword" in held["conf.ini"] and "--dry-run: nothing sent" in out
    assert "not scanned for secrets: weights.bin (binary)" in out


def test_the_staged_upload_holds_exactly_the_files_listed_whatever_their_names(tmp_path):
    """What Ray zips is a staging directory holding the files sent and nothing else: a held file whose name ends in
    a space, holds a backslash or glob characters stays behind, byte-exact names arrive; --allow PATH sends one."""
    from tandem.core.config import JobConfigError
    from tandem.services.app.upload import plan_upload

    write_tree(tmp_path, {"a[1].pem": "x", "a1.pem": "x", "settings.py": SECRET_CONTENT["settings.py"],
                          "keys/server.key": PRIVATE_KEY, "ok.txt": "fine\n", "x\\y.txt": "fine\n",
                          "note.txt ": PRIVATE_KEY, "note.txt": "fine\n"})
    plan = plan_upload(str(tmp_path), allow=["settings.py"])
    assert dict(plan.sent).keys() == {"settings.py", "ok.txt", "x\\y.txt", "note.txt"}
    assert {p for p, _ in plan.held} == {"a[1].pem", "a1.pem", "keys/server.key", "note.txt "}
    stage = Path(plan.stage())
    try:
        arrived = {str(p.relative_to(stage)): p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    finally:
        shutil.rmtree(stage)
    assert arrived == {rel: (tmp_path / rel).read_bytes() for rel, _ in plan.sent}
    assert dict(plan_upload(str(tmp_path), allow=[str(tmp_path / "keys")]).sent).keys() >= {"keys/server.key"}
    with pytest.raises(JobConfigError, match=r"--allow '/etc/passwd': not inside the uploaded directory"):
        plan_upload(str(tmp_path), allow=["/etc/passwd"])
    # an --allow that matches nothing is said, not silently ignored (a typo would send nothing it meant to)
    with pytest.raises(JobConfigError, match=r"--allow 'setings.py': matches no file of the upload"):
        plan_upload(str(tmp_path), allow=["settings.py", "setings.py"])


def test_submit_by_default_sends_what_the_job_names_and_the_modules_they_import(tmp_path, monkeypatch, capsys):
    """No --working-dir: the job file, its data and eval files, the reward file, the module it imports from the
    working directory (and that one's package), what --include adds; no credential of any kind, nothing else."""
    from tandem.services.app.cli import main

    write_tree(tmp_path, {**CREDENTIALS, **SECRET_CONTENT, "data/train.jsonl": '{"prompt": "1 + 1"}\n',
                          "data/eval.jsonl": '{"prompt": "2 + 2"}\n', "unrelated.py": "x = 1\n",
                          "task/rewards.py": "import json\nfrom helpers.scoring import score\n\n"
                                             "def r(completions, **kw):\n    return [score(c) for c in completions]\n",
                          "helpers/__init__.py": "", "helpers/scoring.py": "import numpy\n\ndef score(c):\n"
                                                                           "    return 1.0\n",
                          "README.txt": "read me\n"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "data": {"path": "data/train.jsonl"},
        "eval": {"path": "data/eval.jsonl"}, "rewards": ["task/rewards.py:r", "/elsewhere/r.py:f"],
        "logging": {"output_dir": "/srv/runs/a"}}))
    monkeypatch.chdir(tmp_path)
    rc = main(["submit", "job.yaml", "--include", "README.txt", "--dry-run", "--address", "http://127.0.0.1:9"])
    out = capsys.readouterr().out
    assert rc == 0, out
    sent = {ln[4:].split(" (")[0]: ln.split(" (", 1)[1].rstrip(")") for ln in out.splitlines() if ln.startswith("  + ")}
    assert sent == {"job.yaml": "the job file", "data/train.jsonl": "data.path", "data/eval.jsonl": "eval.path",
                    "task/rewards.py": "rewards", "helpers/__init__.py": "imported by task/rewards.py",
                    "helpers/scoring.py": "imported by task/rewards.py", "README.txt": "--include"}, out
    assert "  = /elsewhere/r.py (rewards)" in out and "  = Qwen/Qwen2.5-0.5B-Instruct (model.path)" in out and "--dry-run: nothing sent" in out
    assert not any(ln.startswith("  - ") for ln in out.splitlines())  # nothing scanned: nothing else is a candidate


def test_lengths_past_the_models_positions_are_refused_naming_both_fields(tmp_path):
    from tandem.core.checks import length_error
    from tandem.core.config import JobConfig

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    job = {"model": {"path": str(tmp_path)}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"]}
    ok = JobConfig.from_dict({**job, "generation": {"max_prompt_length": 256, "max_completion_length": 256}})
    assert length_error(ok) is None
    bad = JobConfig.from_dict({**job, "generation": {"max_prompt_length": 300, "max_completion_length": 256}})
    msg = length_error(bad)
    assert "max_prompt_length + generation.max_completion_length = 300 + 256 = 556" in msg
    assert "model's 512 positions" in msg and "allowed: a sum <= 512" in msg


def test_a_resource_no_node_has_is_named_with_what_the_nodes_have():
    from tandem.core.checks import resource_errors
    from tandem.core.config import JobConfig

    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "memory": 1e9}},
             {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0, "rollout": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]  # a dead node holds nothing
    job = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"]}

    def errs(cluster):
        return resource_errors(JobConfig.from_dict({**job, "cluster": cluster}), nodes)
    assert errs({}) == []
    assert errs({"rollout_resources": {"num_cpus": 4, "num_gpus": 1, "resources": {"rollout": 1}}}) == []
    # each fits some node, but not together on one: refused
    (e,) = errs({"rollout_resources": {"num_cpus": 6, "num_gpus": 1}})
    assert e.startswith("cluster.rollout_resources = {'CPU': 6.0, 'GPU': 1.0}: no node") and "'GPU': 1.0}" in e
    (e,) = errs({"learner_resources": {"num_gpus": 2}})
    assert "cluster.learner_resources" in e and "the most any node has: {'CPU': 8.0, 'GPU': 1.0}" in e
    assert len(errs({"learner_resources": {"resources": {"learner": 1}},
                     "rollout_resources": {"num_gpus": 0.5, "resources": {"rollout": 2}}})) == 2
    # colocated: one actor asks for both, summed; each alone fits the GPU node, together they do not
    split = {"rollout_resources": {"num_cpus": 2, "num_gpus": 0.5}, "learner_resources": {"num_cpus": 3, "num_gpus": 0.5}}
    assert errs(split) == [] and errs({**split, "vllm_mode": "colocate"}) != []
    (e,) = errs({**split, "vllm_mode": "colocate"})
    assert e.startswith("cluster.rollout_resources + learner_resources (vllm_mode colocate: one actor) = "
                        "{'CPU': 5.0, 'GPU': 1.0}: no node")
    assert errs({**split, "learner_resources": {"num_cpus": 2, "num_gpus": 0.5}, "vllm_mode": "colocate"}) == []


def test_colocate_needs_one_learner_process():
    from tandem.core.config import JobConfig, JobConfigError

    job = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"]}
    assert JobConfig.from_dict({**job, "cluster": {"vllm_mode": "colocate"}}).cluster.vllm_mode == "colocate"
    with pytest.raises(JobConfigError, match=r"cluster.vllm_mode = 'colocate' with cluster.num_processes = 2.*"
                                             r"allowed: num_processes 1, or vllm_mode 'server'"):
        JobConfig.from_dict({**job, "cluster": {"vllm_mode": "colocate", "num_processes": 2}})
    with pytest.raises(JobConfigError, match="cluster.vllm_mode = 'colocated': must be 'server' or 'colocate'"):
        JobConfig.from_dict({**job, "cluster": {"vllm_mode": "colocated"}})


def test_relative_paths_become_absolute_against_the_drivers_directory(tmp_path):
    """`tandem run --address`: the actors start in the cluster's directories, not the driver's."""
    from tandem.core.config import JobConfig, with_absolute_paths

    (tmp_path / "models/tiny").mkdir(parents=True)  # exists here: a local path (else `models/tiny` is a Hub id)
    cfg = JobConfig.from_dict({"model": {"path": "models/tiny"}, "data": {"path": "data/train.jsonl"},
                               "eval": {"path": "/abs/eval.jsonl"}, "rewards": ["rewards.py:r", "pkg.mod:f"],
                               "logging": {"output_dir": "runs/a"}})
    got = with_absolute_paths(cfg, tmp_path)
    assert got.model.path == str(tmp_path / "models/tiny") and got.data.path == str(tmp_path / "data/train.jsonl")
    assert got.eval.path == "/abs/eval.jsonl" and got.rewards == [f"{tmp_path}/rewards.py:r", "pkg.mod:f"]
    assert got.logging.output_dir == str(tmp_path / "runs/a") and got.checkpoint.dir is None
    assert got.checkpoint_dir == str(tmp_path / "runs/a" / "checkpoints")
    assert cfg.data.path == "data/train.jsonl"  # the job itself is untouched
    hub = with_absolute_paths(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": "org/tiny"})}),
                              tmp_path)
    assert hub.model.path == "org/tiny"  # no such local path: a Hub id, resolved on each node


@pytest.fixture
def checked_files(job_files, tiny_model):
    """job_files with a model that has a tokenizer: `tandem check` tokenises the prompts as the controller will."""
    return {**job_files, "model": {**job_files["model"], "path": tiny_model}}


def test_tandem_check_reads_the_data_and_refuses_what_trains_nothing(checked_files, tmp_path, capsys):
    """A 0-row data file, a whitespace-only prompt (text or chat) and max_steps 0: each refused by `tandem check` in
    one line naming the file and row or the field."""
    from tandem.services.app.cli import main

    data = tmp_path / "data.jsonl"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(checked_files))
    assert main(["check", str(job)]) == 0 and "valid" in capsys.readouterr().out
    cases = {"": f"data.path = {str(data)!r}: no rows",
             json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": " \t\n"}) + "\n":
                 f"{data}: row 1: the prompt ('prompt') is ' \\t\\n', empty or whitespace only",
             json.dumps({"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "  "}]}) + "\n":
                 f"{data}: row 0: the prompt ('prompt') is [",
             }
    for text, want in cases.items():
        data.write_text(text)
        assert main(["check", str(job)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith(f"tandem: {want}"), (want, err)
    data.write_text(json.dumps({"prompt": "ok"}) + "\n")
    assert main(["check", str(job), "--set", "batch.max_steps=0"]) == 2
    assert "batch.max_steps = 0: trains nothing; allowed: -1" in capsys.readouterr().err


def test_two_runs_sharing_a_checkpoint_dir_are_refused_and_no_lock_outlives_a_run(tmp_path, job_files):
    """The run lock covers every directory a run writes: a second job with its own output_dir but the first one's
    checkpoint.dir is refused naming checkpoint.dir, and takes no lock of its own on the way; when a run ends, or is
    refused, no .tandem.lock is left; a run after it takes the directories again."""
    from tandem.services.app.run import LOCK_FILE, hold_run_dirs

    shared = str(tmp_path / "ckpts")
    first = cfg_of(job_files, logging={"output_dir": str(tmp_path / "a")}, checkpoint={"dir": shared})
    second = cfg_of(job_files, logging={"output_dir": str(tmp_path / "b")}, checkpoint={"dir": shared})
    with hold_run_dirs(first):
        assert (tmp_path / "a" / LOCK_FILE).exists() and (tmp_path / "ckpts" / LOCK_FILE).exists()
        with pytest.raises(JobConfigError, match=rf"checkpoint.dir = '{re.escape(shared)}': a job is already running "
                                                 rf"in it \(pid {os.getpid()} on "):
            with hold_run_dirs(second):
                pass
        assert not (tmp_path / "b" / LOCK_FILE).exists()  # the refused run's own lock released and removed
    assert not list(tmp_path.rglob(LOCK_FILE))
    with hold_run_dirs(second):  # free again
        pass
    assert not list(tmp_path.rglob(LOCK_FILE))
    inside = cfg_of(job_files, logging={"output_dir": str(tmp_path / "c")}, checkpoint={"dir": str(tmp_path / "c" / "k")})
    with hold_run_dirs(inside):  # a checkpoint.dir inside output_dir: one lock
        assert [p.parent.name for p in tmp_path.rglob(LOCK_FILE)] == ["c"]


def test_a_bad_target_module_is_the_same_named_refusal_from_the_transformers_engine(tiny_model):
    """fast_inference false builds its sampler with peft too: the same JobConfigError the learner gives (it crosses a
    Ray actor's boundary as itself; peft's ValueError arrived as an UnserializableException)."""
    import types

    from tandem.rollout.engines.hf_engine import HFEngine

    lora = types.SimpleNamespace(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["foo_proj"])
    with pytest.raises(JobConfigError, match=r"model.lora.target_modules = \['foo_proj'\]: Target modules \{'foo_proj'\} "
                                             r"not found.*allowed: names of .*'q_proj'"):
        HFEngine(tiny_model, lora=lora)
    assert pickle.loads(pickle.dumps(JobConfigError("x"))).args == ("x",)


def test_tandem_check_calls_a_job_with_an_earlier_run_valid_and_says_what_run_would_do(checked_files, tmp_path, capsys):
    """After a run (as right after `make demo`), `tandem check` says valid and what `tandem run` would do with the
    run in output_dir, as run itself decides it."""
    from tandem.services.app.cli import main

    out = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**checked_files, "logging": {"output_dir": str(out)}}))
    assert main(["check", str(job)]) == 0 and "earlier run" not in capsys.readouterr().out
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for sets, said in (([], "`tandem run` would refuse it as it is; set checkpoint.resume: true"),
                       (["checkpoint.resume=true"], "`tandem run` resumes it"),
                       (["logging.overwrite_output_dir=true"], "`tandem run` starts over there")):
        assert main(["check", str(job), *(x for s in sets for x in ("--set", s))]) == 0
        printed = capsys.readouterr().out
        assert f"{job}: valid;" in printed and f"{out} holds an earlier run ({out / 'metrics.jsonl'}): {said}" in \
            printed, printed


def test_tandem_check_says_what_this_machine_lacks_that_run_here_would_refuse(checked_files, tmp_path, capsys):
    """float16 on a CPU, a GPU no node here has: valid for a cluster (check validates from a laptop), and the line
    run here would give is said beside it."""
    from tandem.services.app.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**checked_files, "model": {**checked_files["model"], "dtype": "float16"},
                                   "cluster": {"rollout_resources": {"num_gpus": 1}}}))
    assert main(["check", str(job)]) == 0
    printed = capsys.readouterr().out
    assert "valid;" in printed and "on this machine `tandem run` would refuse it: model.dtype = 'float16': needs CUDA" \
        in printed and "on this machine `tandem run` would refuse it: cluster.rollout_resources = " in printed, printed


def test_submit_refuses_a_relative_run_directory_before_the_cluster(job_files, tmp_path, monkeypatch, capsys):
    """Under `tandem submit` a relative output_dir (or checkpoint.dir) is Ray's temporary copy of the working directory
    on the head: the metrics, checkpoints and adapter would go when the cluster stops. Refused in one line, before
    anything is sent (the address is a closed port)."""
    from tandem.services.app.cli import main

    monkeypatch.chdir(tmp_path)
    for sets, field in ((["logging.output_dir=run"], "logging.output_dir = 'run'"),
                        ([f"logging.output_dir={tmp_path / 'out'}", "checkpoint.dir=ck"], "checkpoint.dir = 'ck'")):
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_files))
        rc = main(["submit", "job.yaml", "--dry-run", "--address", "http://127.0.0.1:9",
                   *(x for s in sets for x in ("--set", s))])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"tandem: {field}: relative; under `tandem submit`"), err
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**job_files, "logging": {"output_dir": str(tmp_path / "o")}}))
    assert main(["submit", "job.yaml", "--dry-run", "--address", "http://127.0.0.1:9"]) == 0


def test_tandem_check_refuses_what_run_would_refuse_once_its_actors_started(job_files, tiny_model, tmp_path, capsys):
    """A target module the model lacks (the learner's and the engines' own refusal, on the model built from its config
    on the meta device) and an environment whose constructor needs arguments (one instance per episode is made with none): both
    refused by `tandem check` in one line; so are the prompts the controller cannot tokenise: a tools
    job whose template has no tool turns or whose prompts are text, a system prompt that pushes a prompt past
    max_prompt_length, a model without a tokenizer."""
    from tandem.services.app.cli import main

    env = tmp_path / "env.py"
    env.write_text("class Needy:\n    def __init__(self, level):\n        self.level = level\n"
                   "    def reset(self, **row):\n        return None\n")
    job = tmp_path / "job.yaml"
    base = {**job_files, "model": {"path": tiny_model, "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}}}
    cases = {"lora": ({"model": {**base["model"], "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["foo_proj"]}}},
                      "model.lora.target_modules = ['foo_proj']: Target modules {'foo_proj'} not found"),
             "env": ({"environment": f"{env}:Needy", "model": {**base["model"], "fast_inference": False}},
                     f"environment = {env}:Needy: its constructor cannot be called without arguments (missing a "
                     "required argument: 'level')")}
    tools_model = tmp_path / "tools_model"  # the tiny model with a chat template that renders tool turns
    shutil.copytree(tiny_model, tools_model)
    build_tokenizer(512, tool_tokens=True).save_pretrained(tools_model)
    (tmp_path / "tools.py").write_text('def add(a: int, b: int) -> int:\n    """Adds.\n\n    Args:\n        a: one\n'
                                       '        b: two\n    """\n    return a + b\n')
    tools = [f"{tmp_path / 'tools.py'}:add"]
    plain_model = tmp_path / "plain_model"  # a chat template that drops tool messages
    shutil.copytree(tiny_model, plain_model)
    plain = build_tokenizer(512)
    plain.chat_template = ("{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                           "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                           "{% endif %}")
    plain.save_pretrained(plain_model)
    data = job_files["data"]["path"]
    cases.update({  # what the controller refuses as it tokenises the prompts
        "no tool turns": ({"tools": tools, "model": {**base["model"], "path": str(plain_model)}},
                          f"model {str(plain_model)!r}: its chat template does not render tool messages"),
        "text prompts": ({"tools": tools, "model": {**base["model"], "path": str(tools_model)}},
                         f"{data}: dataset row 0: a job with tools needs chat prompts (a list of messages), got str"),
        "system prompt": ({"data": {"path": data, "system_prompt": "Think step by step. " * 40},
                           "generation": {"max_prompt_length": 64}},
                          f"{data}: dataset row 0: prompt has "),
        "no tokenizer": ({"model": {**base["model"], "path": job_files["model"]["path"]}},
                         "no tokenizer could be loaded from it")})
    job.write_text(yaml.safe_dump(base))
    assert main(["check", str(job)]) == 0
    capsys.readouterr()
    for name, (over, said) in cases.items():
        job.write_text(yaml.safe_dump({**base, **over}))
        assert main(["check", str(job)]) == 2, name
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and said in err, (name, err)
        assert name != "lora" or f"allowed: names of {tiny_model}'s linear layers, e.g. [" in err and "'q_proj'" in err, err


def test_the_driver_takes_ctrl_c_even_where_tandem_run_was_started_with_sigint_ignored():
    """`tandem run ... &` in a script (or under nohup) starts with SIGINT ignored, which a child inherits: the driver
    then ignored the one SIGINT the supervisor passes on and trained on (found with `kill -INT`). The supervisor's
    child setup gives the driver Python's Ctrl-C handler whatever it inherited."""
    import subprocess
    import sys

    from tandem.services.app.supervisor import _child_setup

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is "
                 "signal.default_int_handler)"]
        plain = subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip()
        driver = subprocess.run(probe, capture_output=True, text=True, timeout=60,
                                preexec_fn=_child_setup).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, old)
    assert (plain, driver) == ("False", "True")


@pytest.mark.alone
def test_semaphores_a_killed_run_left_are_released_by_the_next_start(tmp_path):
    """A process pool's semaphores (/dev/shm/sem.mp-*) outlive a process killed by SIGKILL, and so does the run whose
    supervisor was killed too (its own release never ran): the next `tandem run` of the same user releases them
    before it starts, and leaves a live process's alone. (alone: it reads every process's /dev/shm state)"""
    import io
    import signal
    import subprocess
    import sys
    import time

    from tandem.services.app.supervisor import mapped_names, supervise
    from tests.helpers import unmapped_semaphores

    code = ("import multiprocessing as mp, sys, time\nctx = mp.get_context('spawn')\nlocks = [ctx.Lock() for _ in "
            "range(3)]\nprint('ready', flush=True)\ntime.sleep(600)\n")
    before = unmapped_semaphores()
    killed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "ready" and alive.stdout.readline().strip() == "ready"
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        deadline = time.time() + 10
        while not (left := unmapped_semaphores() - before) and time.time() < deadline:
            time.sleep(0.1)
        assert left, "the killed process left no semaphore behind (nothing to test)"
        mapped_by_alive = {n for n in mapped_names() if n.startswith("sem.mp-")}
        # the next run (one refused at once: its own release at the end only sees what it made itself)
        assert supervise([str(tmp_path / "missing.yaml")], 0, out=io.StringIO()) != 0
        assert not (unmapped_semaphores() & left), "the next start left the killed run's semaphores"
        assert mapped_by_alive <= {n for n in mapped_names() if n.startswith("sem.mp-")}  # a live one's kept
    finally:
        alive.kill()
        alive.wait()


def test_a_module_the_job_imports_holding_a_credential_refuses_the_upload_naming_it(tmp_path, monkeypatch, capsys):
    """The default upload scans what it sends: a module the reward file imports holding an AWS key pair refuses the
    submission in one line naming the module and why it is sent; --allow sends it anyway."""
    from tandem.services.app.cli import main

    write_tree(tmp_path, {"data.jsonl": '{"prompt": "1 + 1"}\n',
                          "rewards.py": "from mycfg import KEY\n\ndef r(completions, **kw):\n    return [0.0]\n",
                          "mycfg.py": 'KEY = "AKIAIOSFODNN7EXAMPLE"\nSECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"\n'})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "data": {"path": "data.jsonl"}, "rewards": ["rewards.py:r"],
        "logging": {"output_dir": "/srv/runs/a"}}))
    monkeypatch.chdir(tmp_path)
    rc = main(["submit", "job.yaml", "--dry-run", "--address", "http://127.0.0.1:9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("tandem: mycfg.py (imported by rewards.py): looks like a credential (") and \
        "--allow mycfg.py" in err[0], err
    rc = main(["submit", "job.yaml", "--dry-run", "--allow", "mycfg.py", "--address", "http://127.0.0.1:9"])
    out = capsys.readouterr().out
    assert rc == 0 and "  + mycfg.py (imported by rewards.py)" in out, out
