"""RolloutWorker: a Ray actor holding one engine that it keeps full.

One thread runs the engine loop (rollout/engine_loop.py), which owns the engine: between engine steps it
adds the prompts that have arrived and loads newly published adapters, so requests enter as prompts arrive
and publishing never waits for generation. Every other call runs in the actor's thread pool (a threaded
actor): `rollout(item)` hands the loop one prompt and returns its scored group the moment its
`num_generations` completions are done; `set_adapter` returns once the engine serves the new version. A
request runs to the end on the adapter version it started with, and its group records that version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tandem.core.actor_names import actor_name
from tandem.core.compat import rollout_env_vars
from tandem.core.engine_memory import (
    SHARE_WITHOUT_SHAPE,
    auto_engine,
    engine_kv_bytes,
    engine_max_num_seqs,
    in_flight,
    prompts_in_flight,
)
from tandem.core.protocol import (
    PromptItem,
    RolloutFailure,
    RolloutGroup,
    as_torch,
    errors_as_text,
    group_meta,
    pack_completions,
)
from tandem.core.shaping import is_informative, overlong_penalty
from tandem.rollout.engine_loop import (
    EngineLoop,
    LoadVersion,
    Request,
    RunEnded,
    Sample,
    StaleRequest,
    StopTraining,
    TrainableFrom,
)
from tandem.rollout.engines.base import Completion, Sampling
from tandem.rollout.episodes import (
    EnvironmentResetError,
    Environments,
    Episode,
    EventLoopThread,
    episode_stats,
)
from tandem.rollout.prompts import PromptError, completion_views, tokenize_prompt
from tandem.rollout.rewards import IsolatedRewards, RewardContractError, RewardError, RewardFunctions
from tandem.rollout.tools import IsolatedTools, tool_schemas


def build_engine(cfg, seed: int):
    m = cfg.model
    if m.fast_inference:
        from tandem.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(m.local_dir(), dtype=m.dtype, lora=m.lora, seed=seed,
                          max_model_len=cfg.generation.max_prompt_length + cfg.generation.max_completion_length,
                          max_loras=cfg.cluster.max_staleness + 2, enforce_eager=cfg.cluster.vllm_enforce_eager,
                          max_num_seqs=engine_max_num_seqs(cfg), merge_adapter=cfg.cluster.vllm_merge_adapter,
                          kv_cache_bytes=cpu_kv_cache_bytes(cfg), inflight=inflight_kv(cfg), **gpu_memory_args(cfg))
    from tandem.rollout.engines.hf_engine import HFEngine

    return HFEngine(m.local_dir(), dtype=m.dtype, lora=m.lora, seed=seed)


def inflight_kv(cfg) -> str | None:
    """The engine's in-flight mode (`cluster.inflight_kv`), None where groups finish under their own version."""
    return cfg.cluster.inflight_kv if in_flight(cfg) else None


def gpu_memory_args(cfg) -> dict:
    """vLLM's share of this process's GPU: `cluster.vllm_gpu_memory_utilization` as set, or (auto) a KV cache of
    exactly what the controller keeps in the engine (tandem/core/engine_memory.py) and the share that, with the
    weights, leaves (vLLM refuses to start where less than that share is free). Nothing off a GPU."""
    import torch

    from tandem.core.checks import language_model_config

    share = cfg.cluster.vllm_gpu_memory_utilization
    auto = auto_engine(cfg, language_model_config(cfg.model.local_dir())) \
        if share == "auto" and torch.cuda.is_available() else None
    if auto is None:
        return {"gpu_memory_utilization": SHARE_WITHOUT_SHAPE if share == "auto" else share}
    kv, engine = auto
    return {"gpu_memory_utilization": min(0.95, engine / torch.cuda.mem_get_info()[1]), "gpu_kv_cache_bytes": kv}


@errors_as_text
class RolloutWorker:
    """Lifecycle: `RolloutWorker(cfg, id)` stores; `setup()` imports the reward functions, starts the
    engine and its loop; then `rollout` / `generate` / `set_adapter` calls, any number at once;
    `shutdown()` stops the loop and closes the engine."""

    def __init__(self, cfg, worker_id: int = 0):
        self.cfg, self.worker_id = cfg, worker_id
        self.sampling = Sampling.from_config(cfg)
        self.loop = EngineLoop(lora=cfg.model.lora is not None, max_staleness=cfg.cluster.max_staleness,
                               inflight=inflight_kv(cfg) is not None)
        self.episodes = None  # the episode runner of a job with tools or an environment (setup)
        self.environments = None
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._lock = threading.Lock()  # stats
        self._stats = Counter(groups=0, failures=0, tokens=0, requests=0, stopped_stale=0, stopped_at_end=0)
        self._times = {"score_s": 0.0, "engine_start_s": 0.0}
        self._started_at = time.time()

    # ------------------------------------------------------------------------------ lifecycle

    def setup(self) -> dict:
        from transformers import AutoTokenizer

        from tandem.core.checks import model_error, raise_on_node, reward_errors

        try:  # one line naming the model or the function and this node, before the engine starts
            raise_on_node(f"rollout worker {self.worker_id}", [model_error(self.cfg), *reward_errors(self.cfg)])
            t = self.cfg.reward_timeout_s
            self.rewards = (RewardFunctions(self.cfg.rewards) if t is None else
                            IsolatedRewards(self.cfg.rewards, t, int(self.cfg.cluster.rollout_resources.num_cpus)))
            self.rewards.start()
            self.tok = AutoTokenizer.from_pretrained(self.cfg.model.local_dir())
            self.episodes = episode_runner(self.cfg, self.tok, self.loop.submit)
            if self.episodes is not None:
                self.episodes_loop = EventLoopThread()
                self.environments = Environments.load(self.cfg.environment) if self.cfg.environment else None
                # as job_tool_schemas orders them for the controller's prompts, from what the runner loaded and checked
                self.schemas = tool_schemas(list(self.episodes.tools.values())) + (
                    self.environments.schemas() if self.environments else [])
        except BaseException as e:
            self._setup_error = e
            self._ready.set()
            raise
        self._loop_thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._loop_thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            raise self._setup_error
        return self.health()

    def _run(self) -> None:
        """The engine is built by the thread that steps it: vLLM's CPU backend pins the OpenMP threads
        of the thread that starts it, and CUDA graphs replay on the stream of the thread that captured them."""
        try:
            t0 = time.time()
            self.engine = build_engine(self.cfg, seed=self.cfg.seed + 1000 * self.worker_id)
            self._times["engine_start_s"] = time.time() - t0
            print(f"RolloutWorker {self.worker_id}: {type(self.engine).__name__} started in "
                  f"{self._times['engine_start_s']:.1f} s", flush=True)
        except BaseException as e:  # noqa: BLE001 - raised by setup in the caller's thread
            self._setup_error = e
            self._ready.set()
            return
        self._started_at = time.time()
        self._ready.set()
        self.loop.run(self.engine)

    @property
    def version(self) -> int:
        """The newest policy version served: 0 = the base model, v = the v-th published adapter."""
        return self.loop.version

    def shutdown(self) -> None:
        self.loop.stop()
        if getattr(self, "_loop_thread", None) is not None:
            self._loop_thread.join(timeout=30)
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "episodes_loop", None) is not None:
            self.episodes_loop.close()
        if self.episodes is not None:
            self.episodes.close()

    def _await_ready(self) -> None:
        self._ready.wait()  # a threaded actor may run a call before setup has finished
        if self._setup_error is not None:
            raise RuntimeError(f"RolloutWorker {self.worker_id}: setup failed: {self._setup_error}")

    # ------------------------------------------------------------------------------ calls

    def set_adapter(self, version: int, tensors) -> int:
        """Serve a published policy (a WeightsPayload, or a state dict): loaded between two engine steps,
        requests already running finish on the version they started with. Returns once requests
        submitted from now on use it."""
        self._await_ready()
        cmd = LoadVersion(version, as_torch(tensors))
        self.loop.submit(cmd)
        cmd.done.wait()
        if cmd.error is not None:
            raise cmd.error
        return self.version

    def trainable_from(self, version: int) -> None:
        """No training will take a group sampled before `version`: training requests on older ones stop at the
        engine's next step (rollout/engine_loop.py), without waiting for the publish that would stop them."""
        self._await_ready()
        self.loop.submit(TrainableFrom(version))

    def stop_training(self) -> None:
        """The run took its last batch: the training requests in the engine stop now (rollout/engine_loop.py's
        StopTraining); their prompts come back as stopped, left for a resume."""
        self._await_ready()
        self.loop.submit(StopTraining())

    def _sample(self, items: list[PromptItem], sampling: Sampling, training: bool = False
                ) -> list[Sampled | RolloutFailure]:
        """Each item's completions, sampled in one request of n completions; with tools or an environment, the n
        episodes of each item, all of them at once on the worker's event loop (rollout/episodes.py). training: the
        requests are training groups', stopped once they can never be trained (a RolloutFailure with its
        stale_version: rollout/engine_loop.py)."""
        if self.episodes is not None:  # a training group's episodes in flight where its single turn would be
            live = training and self.loop.inflight and self.engine.updates_in_flight
            return self.episodes_loop.run(run_groups(self, items, sampling, live))
        per_prompt = self.cfg.generation.seed_per_prompt
        reqs = [Request(it.prompt_ids, seeded(sampling, self.cfg.seed, it.group_id) if per_prompt else sampling,
                        it.min_version, stoppable=training) for it in items]
        for r in reqs:
            self.loop.submit(Sample(r))
        out = []
        for it, r in zip(items, reqs):
            r.done.wait()
            if isinstance(r.error, StaleRequest):
                out.append(self.stopped(it, r.error))
            elif r.error is not None:
                raise r.error
            else:
                out.append(Sampled(r.result, r.version, r.submitted))
        return out

    def stopped(self, it: PromptItem, e: StaleRequest) -> RolloutFailure:
        """A training request the loop stopped, counted: at the run's end (what no training would take) or for the
        bound."""
        with self._lock:
            self._stats["stopped_at_end" if isinstance(e, RunEnded) else "stopped_stale"] += 1
        return RolloutFailure(it.group_id, it.index, f"dataset row {it.index}: {e}", self.worker_id,
                              stale_version=e.version)

    def episode_prompts(self, it: PromptItem, observations: list[str | None]) -> list[np.ndarray]:
        """The item's prompt ids, or each episode's: the prompt with its environment's reset text after the last
        message (tokenised here with the tools' schemas, as the controller tokenises prompts)."""
        if not any(observations):
            return [it.prompt_ids]
        g = self.cfg.generation
        out = [tokenize_prompt(self.tok, self.environments.prompt_with(it.prompt, o or ""), tools=self.schemas,
                               max_prompt_length=g.max_prompt_length, truncate=self.cfg.data.truncate_long_prompts,
                               row=it.index) for o in observations]
        return out[:1] if all(np.array_equal(p, out[0]) for p in out) else out

    def generate(self, items: list[PromptItem], sampling: Sampling | None = None) -> list[RolloutGroup | RolloutFailure]:
        """The groups of `items`, in order, once all are done. `sampling` overrides the job's sampling
        parameters (tests, evaluation)."""
        self._await_ready()
        t0 = time.time()
        return [self._group(it, r, t0) for it, r in zip(items, self._sample(items, sampling or self.sampling))]

    def rollout(self, item: PromptItem) -> tuple:
        """One prompt, for `.options(num_returns=2)`: its small metadata, then the group (or failure),
        so the controller routes the group's ref as it arrives without fetching the payload."""
        self._await_ready()
        t0 = time.time()
        g = self._group(item, self._sample([item], self.sampling, training=True)[0], t0)
        return group_meta(g, self._informative(g)), g

    def _informative(self, g) -> bool:
        if not isinstance(g, RolloutGroup):
            return True
        gr, gen = self.cfg.grpo, self.cfg.generation
        pen = None if gr.overlong_buffer_len is None else overlong_penalty(
            g.lengths, gen.max_completion_length, gr.overlong_buffer_len, gr.overlong_penalty_factor)
        return is_informative(g.rewards, self.cfg.column_weights(), pen)

    def _group(self, it: PromptItem, req: Sampled | RolloutFailure, t0: float) -> RolloutGroup | RolloutFailure:
        if isinstance(req, RolloutFailure):
            if req.stale_version is None:
                with self._lock:
                    self._stats["failures"] += 1
            return req
        comps, eps = req.result, req.episodes
        t1 = time.time()
        ids = [c.tokens for c in comps]
        rewards = self._scored(it, ids, eps, req.envs)
        if isinstance(rewards, RolloutFailure):
            return rewards
        tokens, offsets = pack_completions(ids)
        lps, _ = pack_completions([c.logprobs for c in comps])
        versions = None if all(c.versions is None for c in comps) else pack_completions(
            [np.full(len(c.tokens), req.version, np.int32) if c.versions is None else c.versions for c in comps])[0]
        score_s = time.time() - t1
        with self._lock:
            self._stats["groups"] += 1
            self._stats["tokens"] += int(len(tokens))
            self._times["score_s"] += score_s
        return RolloutGroup(
            group_id=it.group_id, index=it.index, prompt_ids=it.prompt_ids if req.prompt_ids is None else req.prompt_ids,
            tokens=tokens.astype(np.int32), offsets=offsets, sampler_logprobs=lps.astype(np.float32),
            eos=np.array([c.eos for c in comps], dtype=bool), rewards=rewards, version=req.version,
            token_versions=None if versions is None else versions.astype(np.int32),
            worker=self.worker_id, columns=it.columns,
            timings={"queue_s": max(t0 - it.queued_at, 0.0) if it.queued_at else 0.0,
                     "generate_s": t1 - req.submitted, "score_s": score_s},
            loss_mask=None if all(c.mask is None for c in comps) else np.concatenate(
                [np.ones(len(c.tokens), dtype=bool) if c.mask is None else c.mask for c in comps]),
            episodes=None if eps is None else episode_stats(eps),
        )

    def _scored(self, it: PromptItem, ids: list, eps, envs) -> np.ndarray | RolloutFailure:
        """The group's rewards [G, columns] (an environment's own reward the last column), or the failure that stops
        it: a reward function that raised or answered the wrong shape, or no reward for any completion."""
        G = len(ids)
        columns = {k: [v] * G for k, v in it.columns.items()}
        if envs is not None and isinstance(self.rewards, RewardFunctions):
            columns["environments"] = envs  # TRL passes them; objects do not cross to isolated reward processes
        try:
            rewards = self.rewards.score(
                prompts=[it.prompt] * G,
                completions=(completion_views(self.tok, it.prompt, ids, self.tok.eos_token_id) if eps is None
                             else [e.messages for e in eps]),
                completion_ids=[c.tolist() for c in ids],
                columns=columns,
                rows=[it.index] * G,
            )
            if envs is not None:
                rewards = np.concatenate([rewards, self.environments.rewards(envs, it.index)[:, None]], axis=1)
        except RewardError as e:
            with self._lock:
                self._stats["failures"] += 1
            return RolloutFailure(it.group_id, it.index, str(e), self.worker_id, retryable=False,
                                  fatal=isinstance(e, RewardContractError))
        if np.isnan(rewards).all():  # TRL warns and trains on zeros; a group without any reward teaches nothing
            return RolloutFailure(it.group_id, it.index, f"reward functions {self.cfg.rewards} returned None for all "
                                  f"{G} completions of dataset row {it.index}: not trained on", self.worker_id,
                                  retryable=False, no_reward=True)
        return rewards

    def health(self) -> dict:
        return {"worker": self.worker_id, "version": self.version, "pid": os.getpid()}

    def stats(self) -> dict:
        """Counters since setup; busy_s: wall time with at least one request in the engine."""
        with self._lock:
            out = dict(self._stats, **self._times, **self.loop.timings())
        out["wall_s"] = time.time() - self._started_at
        out.update(worker=self.worker_id, version=self.version)
        return out


@dataclass
class Sampled:
    """One prompt's completions, the version they were sampled with, when sampling began; with tools, their
    episodes (each completion is an episode's ids, tool tokens included)."""

    result: list[Completion]
    version: int
    submitted: float
    episodes: list[Episode] | None = None
    envs: list | None = None  # each episode's environment instance
    prompt_ids: np.ndarray | None = None  # the group's prompt where its episodes began from prompts of their own


def seeded(sampling: Sampling, seed: int, group_id: int) -> Sampling:
    """A prompt's sampling with a seed of its own (the job's seed and its hand-out number): its completions do not
    depend on which other prompts share the engine's steps (generation.seed_per_prompt; off by default: vLLM draws a
    seeded request's noise from a generator of its own, and the transformers engine cannot batch them)."""
    if sampling.seed is not None:
        return sampling
    return dataclasses.replace(sampling, seed=(seed * 1_000_003 + group_id) % (2**31 - 1))


async def run_groups(worker, items: list[PromptItem], sampling: Sampling, live: bool = False
                     ) -> list[Sampled | RolloutFailure]:
    """Every item's episodes at once (live: in flight). Functions, not methods: an actor class with a coroutine
    method becomes an asyncio actor in Ray, whose calls share one thread (publishing would wait behind a rollout)."""
    return list(await asyncio.gather(*(item_episodes(worker, it, sampling, live) for it in items)))


async def item_episodes(w, it: PromptItem, sampling: Sampling, live: bool = False) -> Sampled | RolloutFailure:
    """One item's episodes: with an environment, one instance each (reset with the dataset row; a reset that raises
    fails the prompt as a reward function does) and its methods among the episode's tools; episodes that begin
    from their own prompts keep the group's prompt (their common start) and carry the rest as context."""
    envs, tools, prompts = None, None, [it.prompt_ids]
    if w.environments is not None:
        row = {w.cfg.data.prompt_column: it.prompt, **it.columns}
        try:
            envs, observations = await asyncio.to_thread(w.environments.make, sampling.n, row, it.index)
            prompts = w.episode_prompts(it, observations)
        except (EnvironmentResetError, PromptError) as e:
            return RolloutFailure(it.group_id, it.index, str(e), w.worker_id, retryable=False)
        tools = [dict(w.episodes.tools, **w.environments.tools(e)) for e in envs]
    try:
        eps, version, submitted = await w.episodes.group(prompts, sampling, it.min_version, tools, live)
    except StaleRequest as e:  # a live turn the run's end stopped (RunEnded): the prompt is left for a resume
        return w.stopped(it, e)
    group_prompt = None
    if len(prompts) > 1:  # the group's prompt is their common start; each episode carries the rest as context
        start = common_prefix(prompts)
        for e, p in zip(eps, prompts):
            e.after(p[start:].tolist())
        group_prompt = prompts[0][:start]
    return Sampled([e.completion() for e in eps], version, submitted, eps, envs, group_prompt)


def common_prefix(arrays: list[np.ndarray]) -> int:
    n = min(len(a) for a in arrays)
    same = np.all([a[:n] == arrays[0][:n] for a in arrays], axis=0)
    return int(n if same.all() else np.argmin(same))


def episode_runner(cfg, tokenizer, submit):
    """The job's episode runner (None for a single-turn job): its tools imported, the chat template checked."""
    if not (cfg.tools or cfg.environment):
        return None
    from tandem.core.loader import load_function
    from tandem.rollout.episodes import EpisodeLimits, EpisodeRunner, ToolTurnTemplate

    template = ToolTurnTemplate(tokenizer, cfg.model.local_dir())
    template.check()
    tools = {fn.__name__: fn for fn in (load_function(spec) for spec in cfg.tools or [])}
    limits = EpisodeLimits(cfg.generation.max_completion_length, cfg.generation.max_tool_calling_iterations,
                           cfg.tool_timeout_s)
    isolated = None
    if cfg.tool_isolation == "process" and tools:
        isolated = IsolatedTools(cfg.tools, max(2, int(cfg.cluster.rollout_resources.num_cpus)))
        isolated.start()
        tools = isolated.wrap(tools)
    return EpisodeRunner(tokenizer, template, tools, limits, submit, isolated=isolated)


def rollout_actor_class(cfg, cls=RolloutWorker):
    """RolloutWorker as a threaded Ray actor (call_threads) asking for the job's rollout resources."""
    import ray

    r = cfg.cluster.rollout_resources
    return ray.remote(num_cpus=r.num_cpus, num_gpus=r.num_gpus, resources=r.resources or None,
                      runtime_env={"env_vars": rollout_env_vars(r.num_gpus)},
                      max_concurrency=call_threads(cfg))(cls)


def call_threads(cfg) -> int:
    """Threads of a rollout worker actor: one per prompt in flight (each waits for its group), plus
    publishing, health and stats."""
    return prompts_in_flight(cfg) + 8


def cpu_kv_cache_bytes(cfg) -> int:
    """vLLM's KV cache on CPU (which it allocates and touches whole at start): every sequence the controller
    keeps in the engine at full length, twice over, at least 32 MiB; 256 MiB when the model's config does not
    say its shape. The tiny CPU model's jobs needed 15 MiB of the 256 MiB they were given."""
    from tandem.core.checks import language_model_config

    try:  # 128: vLLM's max_num_seqs on CPU
        return max(32 << 20, 2 * engine_kv_bytes(cfg, language_model_config(cfg.model.local_dir()) or {}, 128))
    except (KeyError, TypeError, ZeroDivisionError):
        return 256 << 20


def start_rollout_worker(cfg, slot: int):
    """A rollout worker actor with its setup started. -> (actor, ref of setup: the worker's health once
    it serves; every other call waits for it inside the actor)"""
    w = rollout_actor_class(cfg).options(name=actor_name("rollout", slot, cfg.logging.output_dir)).remote(cfg, slot)
    return w, w.setup.remote()
