"""RolloutWorker: a Ray actor holding one engine. It samples all `num_generations` completions
of each prompt in one engine call, scores them, and returns one RolloutGroup per prompt (or a
RolloutFailure naming the function and row: reported, never dropped)."""

from __future__ import annotations

import os
import time

import numpy as np

from tandem.core.compat import rollout_env_vars
from tandem.core.protocol import PromptItem, RolloutFailure, RolloutGroup, group_meta, pack_completions
from tandem.rollout.engines.base import Sampling
from tandem.rollout.prompts import completion_views
from tandem.rollout.rewards import RewardError, RewardFunctions


def build_engine(cfg, seed: int):
    m = cfg.model
    if m.fast_inference:
        from tandem.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(m.path, dtype=m.dtype, lora=m.lora, seed=seed,
                          max_model_len=cfg.generation.max_prompt_length + cfg.generation.max_completion_length,
                          max_loras=cfg.cluster.max_staleness + 1)
    from tandem.rollout.engines.hf_engine import HFEngine

    return HFEngine(m.path, dtype=m.dtype, lora=m.lora, seed=seed)


class RolloutWorker:
    """Lifecycle: `RolloutWorker(cfg, id)` stores; `setup()` imports the reward functions and starts the
    engine; then `set_adapter` / `generate` calls; `shutdown()` closes the engine."""

    def __init__(self, cfg, worker_id: int = 0):
        self.cfg, self.worker_id = cfg, worker_id
        self.sampling = Sampling.from_config(cfg)
        self.version = 0  # policy version served: 0 = the base model, v = the v-th published adapter
        self._stats = {"groups": 0, "failures": 0, "tokens": 0, "generate_s": 0.0, "score_s": 0.0}

    def setup(self) -> dict:
        from transformers import AutoTokenizer

        from tandem.core.checks import raise_if, reward_errors

        raise_if(reward_errors(self.cfg))  # one line naming the function, before the engine starts
        self.rewards = RewardFunctions(self.cfg.rewards)
        self.tok = AutoTokenizer.from_pretrained(self.cfg.model.path)
        self.engine = build_engine(self.cfg, seed=self.cfg.seed + 1000 * self.worker_id)
        return self.health()

    def set_adapter(self, version: int, tensors: dict) -> int:
        """Load a published policy; called between engine calls (the actor runs one call at a time)."""
        if version <= self.version:
            return self.version
        if self.cfg.model.lora is not None:
            self.engine.load_adapter(version, tensors)
        else:
            self.engine.load_weights(version, tensors)
        self.version = version
        return version

    def generate(self, items: list[PromptItem], sampling: Sampling | None = None) -> list[RolloutGroup | RolloutFailure]:
        """`sampling` overrides the job's sampling parameters (tests, evaluation)."""
        t0 = time.time()
        use_adapter = self.version if (self.version > 0 and self.cfg.model.lora is not None) else None
        outs = self.engine.generate([it.prompt_ids for it in items], sampling or self.sampling, adapter=use_adapter)
        gen_s = time.time() - t0
        results: list[RolloutGroup | RolloutFailure] = []
        for it, comps in zip(items, outs):
            t1 = time.time()
            ids = [c.tokens for c in comps]
            G = len(comps)
            try:
                rewards = self.rewards.score(
                    prompts=[it.prompt] * G,
                    completions=completion_views(self.tok, it.prompt, ids, self.tok.eos_token_id),
                    completion_ids=[c.tolist() for c in ids],
                    columns={k: [v] * G for k, v in it.columns.items()},
                    rows=[it.index] * G,
                )
            except RewardError as e:
                self._stats["failures"] += 1
                results.append(RolloutFailure(it.group_id, it.index, str(e), self.worker_id, retryable=False))
                continue
            tokens, offsets = pack_completions(ids)
            lps, _ = pack_completions([c.logprobs for c in comps])
            results.append(RolloutGroup(
                group_id=it.group_id, index=it.index, prompt_ids=it.prompt_ids,
                tokens=tokens.astype(np.int32), offsets=offsets, sampler_logprobs=lps.astype(np.float32),
                eos=np.array([c.eos for c in comps], dtype=bool), rewards=rewards, version=self.version,
                worker=self.worker_id, columns=it.columns,
                timings={"queue_s": max(t0 - it.queued_at, 0.0) if it.queued_at else 0.0,
                         "generate_s": gen_s / max(len(items), 1), "score_s": time.time() - t1},
            ))
            self._stats["groups"] += 1
            self._stats["tokens"] += int(len(tokens))
            self._stats["score_s"] += time.time() - t1
        self._stats["generate_s"] += gen_s
        return results

    def generate_refs(self, items: list[PromptItem]) -> tuple:
        """For `.options(num_returns=len(items) + 1)`: small metadata first, then one object per
        group, so the controller routes group refs without fetching their payload."""
        results = self.generate(items)
        return (tuple(group_meta(r) for r in results), *results)

    def health(self) -> dict:
        return {"worker": self.worker_id, "version": self.version, "pid": os.getpid()}

    def stats(self) -> dict:
        return dict(self._stats, worker=self.worker_id, version=self.version)

    def shutdown(self) -> None:
        self.engine.close()


def rollout_actor_class(cfg):
    """RolloutWorker as a Ray actor asking for the job's rollout resources."""
    import ray

    r = cfg.cluster.rollout_resources
    return ray.remote(num_cpus=r.num_cpus, num_gpus=r.num_gpus, resources=r.resources or None,
                      runtime_env={"env_vars": rollout_env_vars(r.num_gpus)}, max_concurrency=1)(RolloutWorker)


def start_rollout_worker(cfg, slot: int):
    """A rollout worker actor with its setup queued (an actor runs its calls in order, so every later
    call finds the engine started). -> (actor, ref of setup: the worker's health once it serves)"""
    w = rollout_actor_class(cfg).remote(cfg, slot)
    return w, w.setup.remote()
