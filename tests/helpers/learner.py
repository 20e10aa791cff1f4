"""Synthetic generation batches and a plain-PyTorch reference step for learner tests."""

import numpy as np
import torch

from tandem.core.protocol import RolloutGroup, pack_completions
from tandem.learner.batch import Samples, collate
from tandem.learner.grpo import aggregate_loss, compute_advantages, per_token_loss
from tandem.learner.logprobs import completion_logprobs
from tandem.learner.model import load_policy, reference_context


def make_groups(n, G, seed=0, vocab=500, version=0):
    """Completions of different lengths (micro-batches get different active-token counts)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        comps = [rng.integers(3, vocab, size=rng.integers(2, 12)).astype(np.int32) for _ in range(G)]
        t, off = pack_completions(comps)
        out.append(RolloutGroup(
            group_id=i, index=i, prompt_ids=rng.integers(3, vocab, size=rng.integers(3, 7)).astype(np.int32),
            tokens=t, offsets=off, sampler_logprobs=(-rng.random(len(t)) * 3 - 3).astype(np.float32),
            eos=rng.random(G) < 0.7, rewards=rng.random((G, 1)).astype(np.float32), version=version))
    return out


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def reference_step(cfg, groups, lr, iterations=1):
    """docs/grpo.md §4 on the whole batch at once, plain PyTorch + SGD: no DeepSpeed, no accumulation.
    With iterations > 1: old log-probs once, then `iterations` full-batch SGD steps (PPO epochs)."""
    torch.manual_seed(cfg.seed)
    model = load_policy(cfg)
    for m in model.modules():  # peft's own LoRA forward: the reference does not share the learner's fused op
        if hasattr(m, "_peft_forward"):
            m.forward = m._peft_forward
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    g = cfg.grpo
    s = Samples.from_groups(groups)
    adv = compute_advantages(torch.from_numpy(s.rewards), cfg.batch.num_generations, g.reward_weights, g.scale_rewards)
    mb = collate(s, range(len(s)), adv, pad_id=0, mask_truncated=g.mask_truncated_completions)
    T = cfg.generation.temperature
    kw = dict(epsilon=g.epsilon, epsilon_high=g.epsilon_high, delta=g.delta, beta=g.beta,
              importance_sampling_level=g.importance_sampling_level)
    with torch.no_grad():
        old = completion_logprobs(model, mb, T)[0]
        if g.beta > 0:
            with reference_context(model):
                kw["ref_logp"] = completion_logprobs(model, mb, T)[0]
    if cfg.tis:
        kw.update(sampler_logp=mb["sampler_logp"], tis_cap=g.vllm_importance_sampling_cap,
                  tis_mode=g.vllm_importance_sampling_mode)
    for _ in range(iterations):
        logp, _ = completion_logprobs(model, mb, T)
        o = old if iterations > 1 else logp.detach()
        per = per_token_loss(logp, o, mb["advantages"], mb["mask"], **kw)
        lt = g.loss_type
        if lt == "bnpo":  # local by definition: the mean of the per-micro-batch formula
            B = cfg.batch.per_device_train_batch_size
            loss = sum(aggregate_loss(per[i:i + B], mb["mask"][i:i + B], "bnpo")
                       for i in range(0, len(s), B)) / (len(s) // B)
        else:
            loss = aggregate_loss(per, mb["mask"], lt, max_completion_length=cfg.generation.max_completion_length)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def started(learner):
    """A Learner built in this process and set up (its lifecycle's first step)."""
    learner.setup()
    return learner


def with_tool_spans(groups, seed=0):
    """The groups as multi-turn episodes: in each completion a span of tokens (never the first) becomes a tool's
    output (loss_mask False), the rest the model's own. -> the same groups, masks set."""
    rng = np.random.default_rng(seed)
    for g in groups:
        mask = np.ones(len(g.tokens), dtype=bool)
        for k in range(g.num_generations):
            a, b = int(g.offsets[k]), int(g.offsets[k + 1])
            if b - a >= 3:
                start = int(rng.integers(a + 1, b - 1))
                mask[start:int(rng.integers(start + 1, b))] = False
        g.loss_mask = mask
    return groups
