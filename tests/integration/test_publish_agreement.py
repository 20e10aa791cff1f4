"""After every publish, the sampler's log-probs of the tokens it drew are the learner's log-probs of those tokens under
the same adapter: a rollout worker (real Ray actor, real engine) against the learner's own model (load_policy, its
fused LoRA op) over 20 publishes, half of them an adapter unchanged from the one before (what a step that trained
nothing publishes), half a new one, for each engine and each way an engine takes an adapter."""

import numpy as np
import pytest
import torch

from tandem.core.protocol import PromptItem
from tandem.learner.batch import Samples, collate
from tandem.learner.logprobs import completion_logprobs
from tandem.learner.model import load_policy
from tandem.rollout.engines.base import Sampling
from tandem.rollout.worker import start_rollout_worker
from tests.helpers import ROOT, make_job

pytestmark = pytest.mark.integration
TOL = 1e-5  # fp32 on the CPU: what one model computes twice in two layouts
PUBLISHES = 20


def adapter_like(model, seed):
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * (0.3 if "lora_B" in k else 0.2)
            for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("engine", [
    {"model": {"fast_inference": True}, "cluster": {"vllm_merge_adapter": None}},  # the CPU's default: merged
    {"model": {"fast_inference": True}, "cluster": {"vllm_merge_adapter": False}},  # as LoRA (a GPU's default)
    {"model": {"fast_inference": False}},  # transformers' generate
], ids=["vllm-merged", "vllm-lora", "transformers"])
def test_sampler_and_learner_agree_after_every_publish(ray_session, tiny_model, tmp_path, engine):
    # q and v only: a packed qkv layer the adapter covers in part, as in TRL's quick start
    cfg = make_job(tmp_path, tiny_model, [f"{ROOT}/examples/rewards.py:length_reward"],
                   model={"lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
                          **engine["model"]}, cluster=engine.get("cluster", {}))
    worker, ready = start_rollout_worker(cfg, 40)
    ray_session.get(ready)
    learner = load_policy(cfg).eval()
    from peft import set_peft_model_state_dict

    rng = np.random.default_rng(0)
    items = [PromptItem(group_id=i, index=i, prompt_ids=rng.integers(3, 500, size=5 + i).astype(np.int32),
                        prompt="p", columns={}) for i in range(2)]
    sampling = Sampling(n=4, temperature=1.0, max_tokens=8)
    adapter, worst = adapter_like(learner, 0), []
    try:
        for version in range(1, PUBLISHES + 1):
            if version % 2 == 0:  # every other publish a new adapter, the rest the one before unchanged
                adapter = adapter_like(learner, version)
            assert ray_session.get(worker.set_adapter.remote(version, adapter)) == version
            groups = ray_session.get(worker.generate.remote(items, sampling))
            assert all(g.version == version for g in groups)
            set_peft_model_state_dict(learner, adapter)
            s = Samples.from_groups(groups)
            mb = collate(s, range(len(s)), torch.zeros(len(s)), pad_id=0, mask_truncated=False)
            with torch.no_grad():
                want = completion_logprobs(learner, mb, 1.0)[0]
            m = mb["mask"]
            got = mb["sampler_logp"]
            assert torch.isfinite(got[m]).all(), f"publish {version}: the sampler's log-probs are not finite"
            worst.append(float((got[m] - want[m]).abs().max()))
    finally:
        ray_session.get(worker.shutdown.remote())
        ray_session.kill(worker)
    assert max(worst) <= TOL, f"sampler - learner |log-prob| per publish: {['%.1e' % w for w in worst]}"
