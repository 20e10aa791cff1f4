"""The eval section and logging.report_to: their math, their schedule, their validation, and what a TRL
dict's evaluation and reporting names map to."""

import math
import warnings

import numpy as np
import pytest

from tandem.core import checks
from tandem.core.config import JobConfig, JobConfigError
from tandem.services.orchestrator.evaluator import Evaluator, eval_stats
from tandem.services.orchestrator.trackers import scalars


def test_eval_stats_against_a_plain_loop():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(13, 3))
    r[2, 1] = np.nan  # a function that returned None for one completion
    r[5] = np.nan  # no function scored this one: left out of eval/reward
    lengths, eos = rng.integers(1, 40, size=13), rng.random(13) > 0.3
    w = [0.5, 2.0, -1.0]
    out = eval_stats(r, lengths, eos, w)
    totals = []
    for row in r.tolist():
        if all(math.isnan(x) for x in row):
            continue
        totals.append(sum(wi * x for wi, x in zip(w, row) if not math.isnan(x)))
    mean = sum(totals) / len(totals)
    std = math.sqrt(sum((t - mean) ** 2 for t in totals) / (len(totals) - 1))
    assert out["eval/reward"] == pytest.approx(mean, abs=1e-12)
    assert out["eval/reward_std"] == pytest.approx(std, abs=1e-12)
    assert out["eval/completion_length"] == pytest.approx(sum(lengths.tolist()) / 13)
    assert out["eval/frac_truncated"] == pytest.approx(sum(not e for e in eos.tolist()) / 13)
    col1 = [row[1] for row in r.tolist() if not math.isnan(row[1])]
    assert out["eval/rewards/1/mean"] == pytest.approx(sum(col1) / len(col1))
    assert eval_stats(np.zeros((0, 2)), np.zeros(0), np.zeros(0, bool), None)["eval/reward"] == 0.0


def job(job_files, **sections):
    d = {**job_files, **sections}
    return JobConfig.from_dict(d)


def test_eval_runs_every_eval_steps_and_at_the_end(job_files):
    cfg = job(job_files, eval={"path": job_files["data"]["path"], "eval_steps": 4})
    ev = Evaluator(cfg, table=None, tokenizer=None)
    # cycles of 1 step: 4 and 8; cycles of 3 steps (1-3, 4-6, 7-9): the ones crossing a multiple of 4
    assert [s for s in range(1, 10) if ev.due(s, s, final=False)] == [4, 8]
    assert [(a, a + 2) for a in (1, 4, 7) if ev.due(a, a + 2, final=False)] == [(4, 6), (7, 9)]
    assert ev.due(3, 3, final=True)
    at_end = Evaluator(job(job_files, eval={"path": job_files["data"]["path"]}), None, None)
    assert not any(at_end.due(s, s, False) for s in range(1, 50)) and at_end.due(50, 50, True)


def test_eval_sampling_defaults_to_the_training_temperature_and_0_is_greedy(job_files):
    cfg = job(job_files, generation={"temperature": 0.7}, eval={"path": job_files["data"]["path"]})
    ev = Evaluator(cfg, None, None)
    assert (ev.sampling.n, ev.sampling.temperature) == (1, 0.7)
    cfg = job(job_files, eval={"path": job_files["data"]["path"], "temperature": 0})
    assert (Evaluator(cfg, None, None).sampling.temperature, Evaluator(cfg, None, None).sampling.n) == (0, 1)
    with pytest.raises(JobConfigError, match=r"eval.num_generations = 3 with eval.temperature = 0 \(greedy\)"):
        job(job_files, eval={"path": job_files["data"]["path"], "temperature": 0, "num_generations": 3})


@pytest.mark.parametrize("value, want", [("none", []), (None, []), ("tensorboard", ["tensorboard"]),
                                         (["wandb", "none", "wandb"], ["wandb"]),
                                         ("all", ["tensorboard", "wandb", "mlflow"])])
def test_report_to_takes_trls_forms(job_files, value, want):
    assert job(job_files, logging={"report_to": value}).logging.report_to == want


def test_report_to_refuses_an_unknown_tracker_naming_the_allowed_ones(job_files):
    with pytest.raises(JobConfigError, match=r"logging.report_to.*'trackio' is not a tracker.*tensorboard, "
                                             r"wandb, mlflow"):
        job(job_files, logging={"report_to": ["tensorboard", "trackio"]})


def test_a_missing_tracker_package_names_its_extra(job_files, monkeypatch):
    monkeypatch.setitem(checks.TRACKER_EXTRAS, "mlflow", ("tandem_no_such_module", "mlflow"))
    cfg = job(job_files, logging={"report_to": ["mlflow"]})
    (msg,) = checks.tracker_errors(cfg)
    assert "'tandem_no_such_module' package is not installed" in msg and "tandem[mlflow]" in msg
    assert checks.tracker_errors(job(job_files, logging={"report_to": ["tensorboard"]})) == []


def test_a_missing_eval_file_is_named(job_files):
    cfg = job(job_files, eval={"path": "/nonexistent/eval.jsonl"})
    assert checks.data_error(cfg, "eval.path") == ("eval.path = '/nonexistent/eval.jsonl': no such file or directory, nor a "
                                                   "Hub dataset id")


def trl(job_files, **flat):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return JobConfig.from_trl(flat, model=job_files["model"], data=job_files["data"],
                                  rewards=job_files["rewards"], eval={"path": job_files["data"]["path"]})


def test_trl_eval_and_reporting_names(job_files):
    cfg = trl(job_files, eval_strategy="steps", eval_steps=25, report_to=["tensorboard"], run_name="r1",
              num_generations=4, per_device_train_batch_size=8)
    assert (cfg.eval.eval_steps, cfg.eval.num_generations) == (25, 4)  # TRL: num_generations_eval None
    assert (cfg.logging.report_to, cfg.logging.run_name) == (["tensorboard"], "r1")
    cfg = trl(job_files, eval_strategy="steps", logging_steps=7, num_generations_eval=2)
    assert (cfg.eval.eval_steps, cfg.eval.num_generations) == (7, 2)  # eval_steps None: logging_steps
    cfg = trl(job_files, eval_strategy="steps", eval_steps=0.25, max_steps=10)
    assert cfg.eval.eval_steps == 3  # a share of the run, rounded up as transformers does
    assert trl(job_files, eval_strategy="no", report_to="none").eval.eval_steps == 0
    with pytest.raises(JobConfigError, match=r"eval_strategy='epoch' \(allowed: 'steps', 'no'\)"):
        trl(job_files, eval_strategy="epoch")
    with pytest.raises(JobConfigError, match="eval_steps = 0.5 .* needs max_steps > 0"):
        trl(job_files, eval_strategy="steps", eval_steps=0.5)


def test_only_finite_numbers_reach_the_trackers():
    line = {"step": 3, "time": 1.0, "reward": 0.5, "count/x": 2, "staleness_hist": {"0": 4}, "flag": True,
            "bad": float("nan"), "name": "x"}
    assert scalars(line) == {"reward": 0.5, "count/x": 2.0}
