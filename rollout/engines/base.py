"""The engine contract: token-id prompts in; token ids, the sampler's processed log-probs and
EOS flags out. Two implementations: vLLM (fast_inference) and transformers (generate)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    seed: int | None = None

    @classmethod
    def from_config(cls, cfg, seed: int | None = None) -> Sampling:
        g = cfg.generation
        return cls(n=cfg.batch.num_generations, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                   min_p=g.min_p, repetition_penalty=g.repetition_penalty, max_tokens=g.max_completion_length,
                   seed=seed)


@dataclass
class Completion:
    tokens: np.ndarray  # int32 [L], the EOS token included when it was sampled
    logprobs: np.ndarray  # float32 [L], processed (after temperature and filters)
    eos: bool
    # bool [L]: the tokens the model sampled (True) and those a tool or the environment put there (False), which the
    # loss reads as context only; None: every token is the model's. Carried as it is into RolloutGroup.loss_mask.
    mask: np.ndarray | None = None
    # int32 [L]: the policy version that sampled each token (an in-flight update lands mid-sequence: the engine loop
    # fills it from the request's boundaries, rollout/engine_loop.py); None: every token is the request's version
    versions: np.ndarray | None = None


class Engine:
    """generate() returns, per prompt, `sampling.n` completions; adapters are selected by version.
    serves_one_version: a new version replaces the weights every running request samples with, so it is
    loaded only once none runs (vLLM with the adapter merged).
    streams: requests enter and leave a running engine one by one (`add`, then `step` until each is done); an
    engine that does not stream samples a call's prompts together (`generate`). The engine loop
    (rollout/engine_loop.py) uses one or the other."""

    serves_one_version = False
    streams = False
    can_abort = False  # a streaming engine that can stop a request mid-sampling (`abort`)
    # a streaming engine that takes a new version into the requests already running (in-flight updates): `add(...,
    # live=True)` requests follow every load, `progress` says where each of their sequences stands at it
    updates_in_flight = False

    def generate(self, prompts: list[np.ndarray], sampling: Sampling, adapter: int | None = None
                 ) -> list[list[Completion]]:
        raise NotImplementedError

    def add(self, key: int, prompt: np.ndarray, sampling: Sampling, adapter: int | None = None) -> None:
        """A streaming engine: start sampling one prompt, known by `key` (raises when the engine refuses it)."""
        raise NotImplementedError

    def step(self) -> list[tuple[int, list[Completion]]]:
        """A streaming engine: one step of every running request -> (key, completions) of those that finished."""
        raise NotImplementedError

    def progress(self, key: int) -> dict[int, int]:
        """A running request's sequences still sampling: {its index among the n: tokens sampled so far} (one that
        finished is absent: all of its tokens are behind)."""
        raise NotImplementedError(f"{type(self).__name__}.progress: this engine does not update requests in flight")

    def abort(self, key: int) -> None:
        """Stop request `key` (added, not finished): it frees its sequences and is never returned by `step`."""
        raise NotImplementedError(f"{type(self).__name__}.abort: this engine cannot stop a request")

    def load_adapter(self, version: int, tensors: dict) -> None:
        raise NotImplementedError

    def load_weights(self, version: int, tensors: dict) -> None:
        raise NotImplementedError

    @property
    def adapter_versions(self) -> list[int]:
        """Adapter versions loaded now (an engine that holds one at a time: none to drop)."""
        return []

    def drop_adapters(self, versions) -> None:
        """Unload these adapter versions (no request uses them any more)."""

    def close(self) -> None:
        pass
