"""Wire types between controller, rollout workers and learner. numpy only: cheap to pickle,
no Python object per token (Ray's object store keeps numpy arrays zero-copy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PromptItem:
    """One prompt handed to a rollout worker."""

    group_id: int  # unique per hand-out: a re-queued prompt gets a new one
    index: int  # dataset row
    prompt_ids: np.ndarray  # int32 [P], chat template already applied
    prompt: Any  # the prompt as the data has it (text or chat messages), for reward functions
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns (what rewards see)
    queued_at: float = 0.0  # time.time() when handed out
    epoch: int = 0  # the pass over the dataset it belongs to (controller bookkeeping, not a column)
    min_version: int = 0  # sampled with this policy version or a newer one: a worker holds it until it serves it


@dataclass
class RolloutGroup:
    """All `num_generations` completions of one prompt, sampled by one engine call."""

    group_id: int
    index: int
    prompt_ids: np.ndarray  # int32 [P]
    tokens: np.ndarray  # int32 [sum of completion lengths], completions back to back
    offsets: np.ndarray  # int64 [G + 1]: completion g is tokens[offsets[g]:offsets[g+1]]
    sampler_logprobs: np.ndarray  # float32, aligned with tokens: the sampler's processed log-prob
    eos: np.ndarray  # bool [G]: finished by EOS (False = truncated at max_completion_length)
    rewards: np.ndarray  # float32 [G, F]: one column per reward function, NaN where it returned None
    version: int  # policy version (published adapter count) the engine sampled with: the first, in flight
    worker: int = -1
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, generate_s, score_s
    columns: dict[str, Any] = field(default_factory=dict)
    # aligned with tokens, multi-turn episodes: True on the tokens the model sampled, False on those a tool or the
    # environment put there (trained on as context, never as actions); None: every token is the model's
    loss_mask: np.ndarray | None = None
    # multi-turn episodes: per episode turns, tool_calls, tool_failures, ended (an index of
    # tandem.rollout.episodes.ENDINGS), and the group's tool_s (rollout/episodes.py, episode_stats); None: single-turn
    episodes: dict | None = None
    # int32, aligned with tokens: the version that sampled each token (in-flight updates: a publish reached the
    # request mid-sequence); None: every token is `version`'s
    token_versions: np.ndarray | None = None

    @property
    def num_generations(self) -> int:
        return len(self.offsets) - 1

    def completion(self, g: int) -> np.ndarray:
        return self.tokens[self.offsets[g] : self.offsets[g + 1]]

    def completion_logprobs(self, g: int) -> np.ndarray:
        return self.sampler_logprobs[self.offsets[g] : self.offsets[g + 1]]

    def completion_versions(self, g: int) -> np.ndarray:
        """int32 [L]: the version that sampled each of completion g's tokens."""
        if self.token_versions is None:
            return np.full(int(self.offsets[g + 1] - self.offsets[g]), self.version, dtype=np.int32)
        return self.token_versions[self.offsets[g] : self.offsets[g + 1]]

    @property
    def newest_version(self) -> int:
        """The newest version among its tokens (the one it finished under)."""
        tv = self.token_versions
        return int(tv.max()) if tv is not None and len(tv) else self.version

    def completion_loss_mask(self, g: int) -> np.ndarray:
        """bool [L]: which of completion g's tokens the loss sees (the model's own)."""
        n = int(self.offsets[g + 1] - self.offsets[g])
        if self.loss_mask is None:
            return np.ones(n, dtype=bool)
        return self.loss_mask[self.offsets[g] : self.offsets[g + 1]].astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class RolloutFailure:
    """A prompt that could not become a group (reward function raised, bad output...).

    Reported, never silently dropped: the controller re-queues or records it."""

    group_id: int
    index: int
    message: str  # names the function and the dataset row
    worker: int = -1
    retryable: bool = True
    no_reward: bool = False  # every reward function returned None for every completion: nothing to train on
    fatal: bool = False  # a reward function's answer of the wrong shape or type: the job stops (RewardContractError)
    stale_version: int | None = None  # stopped mid-sampling, its version past max_staleness: sampled again once


def pack_completions(completions: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(completions) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c) for c in completions])
    flat = np.concatenate(completions) if completions else np.zeros(0)
    return flat, offsets


def group_meta(r: RolloutGroup | RolloutFailure, informative: bool = True) -> dict:
    """The few numbers the controller needs about a group without fetching its payload; `informative`:
    its rewards differ (tandem.core.shaping.is_informative), for dynamic sampling."""
    if isinstance(r, RolloutFailure):
        return {"failure": r.message, "no_reward": r.no_reward, "fatal": r.fatal, "stale_version": r.stale_version}
    # version: the one it finished under, which the staleness bound reads (in flight, its older tokens are the
    # learner's to mask); first_version: the one it started with
    meta = {"version": r.newest_version, "first_version": r.version, "tokens": int(len(r.tokens)),
            "group_id": r.group_id, "informative": informative, "inflight_updated": 0}
    if r.token_versions is not None:  # each completion's versions, first to last (logging.group_trace)
        versions = [np.unique(r.completion_versions(g)).tolist() for g in range(r.num_generations)]
        meta.update(completion_versions=versions, inflight_updated=sum(len(v) > 1 for v in versions))
    if r.episodes is not None:
        meta["episodes"] = r.episodes
    return meta


@dataclass
class WeightsPayload:
    """A state dict on the wire (the published adapter): each tensor's bytes as a numpy array, which Ray
    moves out of band and maps from its object store without a copy. A torch tensor itself pickles
    through torch.save, in band: 0.1-0.4 s each way for a 17-31 MB adapter on these CPUs."""

    arrays: dict[str, np.ndarray]  # uint8, the tensor's bytes
    dtypes: dict[str, str]  # torch dtype name, e.g. "bfloat16"
    shapes: dict[str, tuple]

    @classmethod
    def from_torch(cls, tensors: dict) -> WeightsPayload:
        import torch

        arrays, dtypes, shapes = {}, {}, {}
        for k, t in tensors.items():
            t = t.detach().cpu().contiguous()
            arrays[k] = t.reshape(-1).view(torch.uint8).numpy()
            dtypes[k], shapes[k] = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        return cls(arrays, dtypes, shapes)

    def to_torch(self) -> dict:
        """Tensors viewing the arrays (read-only when they sit in Ray's object store: copy before writing)."""
        import warnings

        import torch

        with warnings.catch_warnings():  # torch warns once that the object store's pages are read-only
            warnings.simplefilter("ignore", UserWarning)
            return {k: torch.from_numpy(a).view(getattr(torch, self.dtypes[k])).reshape(self.shapes[k])
                    for k, a in self.arrays.items()}


def as_torch(tensors) -> dict:
    """A WeightsPayload's tensors; a state dict of torch tensors as it is."""
    return tensors.to_torch() if isinstance(tensors, WeightsPayload) else tensors


class ActorError(RuntimeError):
    """An error raised inside an actor whose object would not reach the caller (its class does not unpickle in
    another process, as peft's NoMatchingPeftModuleError; Ray then says only "Failed to deserialize
    exception"): its type, message and traceback travel as text. The first line is what `tandem` prints."""


def carried(e: BaseException) -> BaseException:
    """e itself when it survives a pickle round trip (what Ray does to it), else an ActorError of its text."""
    import pickle
    import traceback

    try:
        from ray import cloudpickle as dumper  # what Ray pickles an error with (inside an actor: always there)
    except ImportError:
        dumper = pickle
    try:
        pickle.loads(dumper.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to carry it is the case handled
        lines = [x for x in str(e).strip().splitlines() if x.strip()]
        return ActorError(f"{type(e).__name__}: {lines[0] if lines else ''}\n\n" + "".join(traceback.format_exception(e)))


def errors_as_text(cls):
    """Class decorator for an actor: every public method's error reaches the caller (carried)."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                c = carried(e)
                if c is e:
                    raise
                raise c from None
        return call
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not name.startswith("_"):
            setattr(cls, name, wrap(fn))
    return cls
