"""After every publish, the sampler's log-probs of the tokens it drew are the learner's log-probs of those tokens under
the same adapter: a rollout worker (real Ray actor, real engine) against the learner's own model over 20 publishes,
half of them an adapter unchanged from the one before, half a new one (tests/helpers/publish.py), for the engine that
serves the adapter merged into its weights (the CPU's default) and transformers' (vLLM's LoRA: test_rollout.py)."""

import pytest

from tandem.rollout.worker import start_rollout_worker
from tests.helpers import ROOT, make_job
from tests.helpers.publish import TOL, worst_gaps_after_publishes

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("engine", [{"fast_inference": True}, {"fast_inference": False}],
                         ids=["vllm-merged", "transformers"])
def test_sampler_and_learner_agree_after_every_publish(ray_session, tiny_model, tmp_path, engine):
    # q and v only: a packed qkv layer the adapter covers in part, as in TRL's quick start
    cfg = make_job(tmp_path, tiny_model, [f"{ROOT}/examples/rewards.py:length_reward"],
                   model={"lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}, **engine},
                   cluster={"vllm_merge_adapter": None})
    worker, ready = start_rollout_worker(cfg, 40)
    ray_session.get(ready)
    try:
        worst = worst_gaps_after_publishes(ray_session, worker, cfg)
    finally:
        ray_session.get(worker.shutdown.remote())
        ray_session.kill(worker)
    assert max(worst) <= TOL, f"sampler - learner |log-prob| per publish: {['%.1e' % w for w in worst]}"
