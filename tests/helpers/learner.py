"""Synthetic generation batches and a plain-PyTorch reference step for learner tests."""

import contextlib

import numpy as np
import torch

from tandem.core.protocol import RolloutGroup, pack_completions
from tandem.learner.model import load_policy


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
    """docs/grpo.md §4 written out again, sample by sample, on the whole batch at once: plain PyTorch and peft, SGD,
    no DeepSpeed, no accumulation, and nothing of the learner (no learner/grpo.py, learner/logprobs.py, collate or
    kernel): what the learner computes must equal this, not itself. With iterations > 1: old log-probs once, then
    `iterations` full-batch SGD steps (PPO epochs)."""
    torch.manual_seed(cfg.seed)
    model = load_policy(cfg)
    for m in model.modules():  # peft's own LoRA forward: the reference does not share the learner's fused op
        if hasattr(m, "_peft_forward"):
            m.forward = m._peft_forward
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    g, T = cfg.grpo, cfg.generation.temperature
    seqs = [(grp.prompt_ids, grp.completion(k), grp.completion_loss_mask(k), grp.completion_logprobs(k), grp.eos[k])
            for grp in groups for k in range(grp.num_generations)]
    adv = reference_advantages(groups, g.reward_weights, g.scale_rewards)
    masks = [torch.tensor(m & (bool(eos) or not g.mask_truncated_completions), dtype=torch.float32)
             for _, _, m, _, eos in seqs]

    def logps(use_adapter=True):
        out = []
        for prompt, comp, _, _, _ in seqs:
            ids = torch.tensor(np.concatenate([prompt, comp]), dtype=torch.long)[None]
            with contextlib.nullcontext() if use_adapter else model.disable_adapter():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / T
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0])
        return out
    with torch.no_grad():
        old = logps()
        ref = logps(use_adapter=False) if g.beta > 0 else None
    for _ in range(iterations):
        new = logps()
        terms = []
        for i, (lp, m) in enumerate(zip(new, masks)):
            o = old[i] if iterations > 1 else lp.detach()
            d = (lp - o) * m
            ratio = torch.exp((d.sum() / m.sum().clamp(min=1)).expand_as(lp)) if g.importance_sampling_level == \
                "sequence" else torch.exp(d)
            r1 = ratio.clamp(max=g.delta) if g.delta is not None else ratio
            r2 = ratio.clamp(1 - g.epsilon, 1 + (g.epsilon_high if g.epsilon_high is not None else g.epsilon))
            loss = -torch.minimum(r1 * adv[i], r2 * adv[i])
            if cfg.tis:
                loss = loss * reference_tis(o.detach(), torch.from_numpy(seqs[i][3]).float(), m,
                                            g.vllm_importance_sampling_cap, g.vllm_importance_sampling_mode)
            if g.beta > 0:
                dr = (ref[i] - lp) * m
                loss = loss + g.beta * (torch.exp(dr) - dr - 1)
            terms.append(loss * m)
        loss = reference_normalised(terms, masks, g.loss_type, cfg.batch.per_device_train_batch_size,
                                    cfg.generation.max_completion_length)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference_advantages(groups, weights, scale: str) -> list[float]:
    """§4.1-2: the weighted reward total (None = NaN counts 0), minus its group's mean, over the group's (or the
    batch's) Bessel std + 1e-4."""
    totals = []
    for grp in groups:
        w = np.ones(grp.rewards.shape[1]) if weights is None else np.asarray(weights, dtype=np.float64)
        totals.append(np.nansum(grp.rewards.astype(np.float64) * w, axis=1))
    everything = np.concatenate(totals)
    out = []
    for t in totals:
        a = t - t.mean()
        if scale == "group":
            a = a / (t.std(ddof=1) + 1e-4)
        elif scale == "batch":
            a = a / (everything.std(ddof=1) + 1e-4)
        out += [float(x) for x in a]
    return out


def reference_tis(old, sampler, m, cap: float, mode: str):
    """§4.6: exp(old − sampler) per token, or summed over the sequence; truncated at cap, or masked above it."""
    d = (old - sampler) * m
    if mode.startswith("sequence"):
        d = d.sum().expand_as(old)
    w = torch.exp(d)
    return torch.where(w > cap, torch.zeros_like(w), w) if mode.endswith("mask") else w.clamp(max=cap)


def reference_normalised(terms, masks, loss_type: str, per_device: int, max_len: int):
    """§4.8 over the whole batch: grpo the mean of each row's token mean; bnpo the mean over micro-batches of their
    token mean; dr_grpo the sum over rows × max_completion_length; dapo the sum over every active token."""
    sums = [t.sum() for t in terms]
    counts = [m.sum() for m in masks]
    if loss_type == "grpo":
        return sum(s / c.clamp(min=1) for s, c in zip(sums, counts)) / len(terms)
    if loss_type == "bnpo":
        parts = [(sum(sums[i:i + per_device]) / sum(counts[i:i + per_device]).clamp(min=1))
                 for i in range(0, len(terms), per_device)]
        return sum(parts) / len(parts)
    if loss_type == "dr_grpo":
        return sum(sums) / (len(terms) * max_len)
    return sum(sums) / sum(counts).clamp(min=1)


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
