"""train(resume_from_checkpoint=PATH) says the true reason for a path it refuses: no such checkpoint, an incomplete or
damaged one, or an older one (each naming the run's newest complete checkpoint by its TRL name), on a run directory
laid out as Tandem writes it (checkpoints/cycle-N with tandem.json; TRL's checkpoint-N pointing at one)."""

import json

import pytest

from tandem.core.config import JobConfig, JobConfigError
from tandem.services.app.trainer import check_resume_target
from tandem.services.orchestrator.trl_checkpoint import POINTER


def run_dir(tmp_path, cycles=(2, 4), damaged=None):
    out = tmp_path / "run"
    for n in cycles:
        c = out / "checkpoints" / f"cycle-{n:06d}"
        c.mkdir(parents=True)
        if n != damaged:
            (c / "tandem.json").write_text(json.dumps({"cycle": n}))
        t = out / f"checkpoint-{n}"
        t.mkdir()
        (t / "trainer_state.json").write_text("{}")
        (t / POINTER).write_text(f"cycle-{n:06d}")
    return JobConfig.from_dict({"model": {"path": str(tmp_path)}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"],
                                "logging": {"output_dir": str(out)}}), out


def test_the_newest_checkpoint_and_true_are_taken(tmp_path):
    cfg, out = run_dir(tmp_path)
    check_resume_target(True, cfg)
    check_resume_target(str(out / "checkpoint-4"), cfg)


@pytest.mark.parametrize("given,damaged,said", [
    ("checkpoint-9", None, "no such checkpoint; the run's newest is {out}/checkpoint-4"),
    ("checkpoint-2", None, "not the run's newest checkpoint ({out}/checkpoint-4)"),
    ("checkpoint-4", 4, "an incomplete or damaged checkpoint (its cycle-000004 has no tandem.json); the run's newest "
                        "complete one is {out}/checkpoint-2"),
])
def test_a_refused_checkpoint_is_told_by_its_true_reason(tmp_path, given, damaged, said):
    cfg, out = run_dir(tmp_path, damaged=damaged)
    with pytest.raises(JobConfigError) as e:
        check_resume_target(str(out / given), cfg)
    assert said.format(out=out) in str(e.value), str(e.value)
