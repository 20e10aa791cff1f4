"""Learning parity: Tandem learns the demo's task as TRL's GRPOTrainer does from the same start and settings, and the
check has teeth: it fails on a defect planted in a real run (the advantages' sign flipped in the learner's process,
the published adapter never served by the rollout worker). Its `max_staleness: 0` run is also the demo's promise
(examples/sevens.yaml, shortened to 20 steps): the eval reward rises from the warmed-up model's.

Both train the demo's warmed-up model (examples/sevens) for STEPS steps with the demo's job (4 prompts x 8
completions a step, lr 2e-3, LoRA r 16, dapo, beta 0); each is evaluated at step 0 and STEPS on the six eval prompts,
64 completions each (bench/learning.py: Tandem's own evaluation with the adapter its worker serves, TRL's model
sampled by transformers). The check (`learns_as`): the eval reward rose by at least RISE and ends within BOUND of
TRL's. BOUND from bench/results/learning_cpu.md (three seeds each, step 20): TRL 0.331 ± 0.009, Tandem
`max_staleness` 0 0.311 ± 0.025 and 1 0.313 ± 0.025, from 0.12-0.13; the largest gap of any pair of seeds there is
0.054, and the eval's sampling alone (384 completions) moves a reading by about 0.01. Both runs are seeded (the same
curve on every run of the same code), so the test does not flip between runs; BOUND 0.1 leaves a correct Tandem
about twice the measured worst gap, and is far inside the defects' effect (seed 0, step 20): advantages flipped
0.018 (the reward falls), adapter unpublished 0.126 (it stays where it started). Inverted TIS weights do not show in learning at this scale (0.318 at max_staleness 1: sampler and learner agree to
about 1e-6 here, so every weight is 1 either way); tests/unit/test_loss.py's reference grid catches that defect
(259 of its cases fail with it planted)."""

import sys

import pytest

from tandem.services.orchestrator.controller import Controller
from tests.helpers import ROOT
from tests.helpers.defects import plant
from tests.helpers.learner import started

sys.path.insert(0, str(ROOT / "bench"))
import learning  # noqa: E402 - bench/learning.py: the task, its evaluation and TRL's run

pytestmark = pytest.mark.integration
STEPS = 20
RISE = 0.1  # the demo's eval reward goes 0.15 -> ~0.4 in 20 steps
BOUND = 0.1


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    return learning.prepare(tmp_path_factory.mktemp("learning"))


@pytest.fixture(scope="module")
def trl(sevens, tmp_path_factory):
    """TRL GRPOTrainer's eval curve (step 0 and STEPS), seed 0."""
    return learning.run_trl(sevens, tmp_path_factory.mktemp("trl"), 0, STEPS, STEPS)


def tandem(sevens, out, k: int) -> list[dict]:
    import time

    t0 = time.time()
    ctl = started(Controller(learning.tandem_job(sevens, out, k, 0, STEPS, STEPS)))
    while not ctl.step()["done"]:
        pass
    ctl.shutdown()
    return learning.eval_curve(out / "metrics.jsonl", t0)


def learns_as(curve: list[dict], ref: list[dict]) -> bool:
    start, end = curve[0]["reward"], curve[-1]["reward"]
    return end >= start + RISE and abs(end - ref[-1]["reward"]) <= BOUND


@pytest.mark.parametrize("k", [0, 1])
def test_tandem_learns_as_trl_grpo_trainer(ray_session, sevens, trl, tmp_path, k):
    assert [p["step"] for p in trl] == [0, STEPS] and trl[-1]["reward"] >= trl[0]["reward"] + RISE, trl
    curve = tandem(sevens, tmp_path / "run", k)
    assert [p["step"] for p in curve] == [0, STEPS]
    assert abs(curve[0]["reward"] - trl[0]["reward"]) <= BOUND  # the same start, two samplers
    assert learns_as(curve, trl), (curve, trl)


@pytest.mark.parametrize("defect", ["flipped_advantages", "unpublished"])
def test_a_planted_defect_fails_the_check(ray_session, sevens, trl, tmp_path, monkeypatch, defect):
    plant(monkeypatch, defect)
    curve = tandem(sevens, tmp_path / "run", 0)
    assert not learns_as(curve, trl), (defect, curve, trl)
