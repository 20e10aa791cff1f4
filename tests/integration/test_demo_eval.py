"""The demo's job, shortened: its evaluation (the six prompts, 8 samples each, seeded) rises with
training, from the warmed-up model's score at step 0 to a clearly higher one after 20 steps."""

import json
import subprocess
import sys

import pytest

from tandem.core.config import JobConfig
from tandem.services.orchestrator.controller import Controller
from tests.helpers import ROOT
from tests.helpers.learner import started

pytestmark = pytest.mark.integration


def test_demo_eval_reward_rises_with_training(ray_session, tmp_path):
    run = tmp_path / "sevens"
    subprocess.run([sys.executable, str(ROOT / "examples/sevens/prepare.py"), str(run)], check=True, cwd=ROOT)
    cfg = JobConfig.from_yaml(ROOT / "examples/sevens.yaml", [
        f"model.path={run / 'model'}", f"data.path={run / 'prompts.jsonl'}", f"eval.path={run / 'eval.jsonl'}",
        f"logging.output_dir={run}", "logging.progress=false", "batch.max_steps=20", "eval.eval_steps=20",
        f"rewards=[{ROOT / 'examples/rewards.py'}:sevens_reward]"])
    ctl = started(Controller(cfg))
    while not ctl.step()["done"]:
        pass
    ctl.shutdown()
    evals = {r["step"]: r["eval/reward"] for r in map(json.loads, (run / "metrics.jsonl").open()) if "eval/reward" in r}
    assert sorted(evals) == [0, 20]
    assert evals[20] > evals[0] + 0.1, evals  # 0.15 -> ~0.4 at step 20 in the demo
