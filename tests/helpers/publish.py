"""The sampler against the learner after publishes: what tests/integration/test_publish_agreement.py and
test_rollout.py run on their workers."""

import numpy as np
import torch

from tandem.core.protocol import PromptItem
from tandem.learner.batch import Samples, collate
from tandem.learner.logprobs import completion_logprobs
from tandem.learner.model import load_policy
from tandem.rollout.engines.base import Sampling

TOL = 1e-5  # fp32 on the CPU: what one model computes twice in two layouts


def adapter_like(model, seed):
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * (0.3 if "lora_B" in k else 0.2)
            for k, v in get_peft_model_state_dict(model).items()}


def worst_gaps_after_publishes(ray, worker, cfg, publishes=20, first_version=1) -> list[float]:
    """`publishes` adapters to `worker`, every other one unchanged from the one before (what a step that trained
    nothing publishes), the rest new; after each, the largest |sampler - learner| log-prob over the tokens the worker
    sampled, the learner being the job's own model (load_policy, its fused LoRA op) holding the same adapter. A
    non-finite sampler log-prob fails at once."""
    from peft import set_peft_model_state_dict

    learner = load_policy(cfg).eval()
    rng = np.random.default_rng(0)
    items = [PromptItem(group_id=i, index=i, prompt_ids=rng.integers(3, 500, size=5 + i).astype(np.int32),
                        prompt="p", columns={}) for i in range(2)]
    sampling = Sampling(n=4, temperature=1.0, max_tokens=8)
    adapter, worst = adapter_like(learner, 0), []
    for version in range(first_version, first_version + publishes):
        if version % 2 == 0:
            adapter = adapter_like(learner, version)
        assert ray.get(worker.set_adapter.remote(version, adapter)) == version
        groups = ray.get(worker.generate.remote(items, sampling))
        assert all(g.version == version for g in groups)
        set_peft_model_state_dict(learner, adapter)
        s = Samples.from_groups(groups)
        mb = collate(s, range(len(s)), torch.zeros(len(s)), pad_id=0, mask_truncated=False)
        with torch.no_grad():
            want = completion_logprobs(learner, mb, 1.0)[0]
        m, got = mb["mask"], mb["sampler_logp"]
        assert torch.isfinite(got[m]).all(), f"publish {version}: the sampler's log-probs are not finite"
        worst.append(float((got[m] - want[m]).abs().max()))
    return worst
