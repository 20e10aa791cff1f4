"""`cluster.vllm_mode: colocate`: rollout worker 0 and the learner's one rank in one Ray actor, one process
(TRL's colocate mode, verl's hybrid engine). One process fewer importing torch, transformers, the model
code and Ray's core worker: on the CPU benchmark's job 1.61 -> 1.36 GB of PSS at 8 completions.
The engine loop samples in its thread while the learner trains in another of the same process: their
kernels release the GIL, their host work shares it. On a GPU the learner's kernels go to a CUDA stream of their
own: one process is one CUDA context, where a learner kernel can run beside the engine's (two processes' kernels
only take turns: the 7B run of bench/results/e2e_gpu_scale.md, the 2026-12-03 run (10868ea), engine and learner each at half speed).

Everything else is the server mode's: the rollout pool feeds this actor as any worker (slot 0), the
LearnerGroup drives its learner through the `learner_*` methods. Its death is the learner's: the job
restarts from its newest checkpoint (cluster.max_restarts); a replacement for slot 0 is a plain worker."""

from __future__ import annotations

import contextlib

from tandem.core.checks import colocated_request
from tandem.core.compat import learner_env_vars, rollout_env_vars
from tandem.learner.group import LearnerActor, forward_learner_methods
from tandem.rollout.worker import RolloutWorker, call_threads, start_rollout_worker

PREFIX = "learner_"
# glibc gives each thread that allocates its own malloc arena, and keeps what they free: the learner's calls
# run on whichever of the actor's pool threads is free, so without a cap every one of them grows an arena
# (the CPU benchmark's job: this process 1.01 GB after 22 steps and growing; capped 0.85 GB there, 0.88 after 60)
COLOCATED_ENV = {"MALLOC_ARENA_MAX": "2"}
# CUDA maps a priority past the device's range to its highest (torch.cuda.Stream's documentation)
ENGINE_PRIORITY = -100


class ColocatedWorker(RolloutWorker):
    """A RolloutWorker (worker 0) whose process also holds the learner, built from the learner's arguments."""

    def __init__(self, cfg, *learner_args):
        super().__init__(cfg, 0)
        self._learner = LearnerActor(cfg, *learner_args)
        self._learner_stream = None

    def _run(self) -> None:
        """The engine on a stream of the highest priority (this thread's; vLLM keeps a thread's stream as the one its
        CUDA graphs replay on): where a learner kernel and the engine's wait for the same free SMs, the engine's
        short decode kernels go first, and the learner fills what they leave."""
        import torch

        if torch.cuda.is_available() and self.cfg.model.fast_inference:
            from vllm.utils.torch_utils import current_stream  # patches torch.cuda.set_stream to record the stream

            torch.cuda.set_stream(torch.cuda.Stream(priority=ENGINE_PRIORITY))
            print(f"ColocatedWorker: engine stream priority {current_stream().priority}", flush=True)
        super()._run()

    def learner_setup(self, address=None) -> int:
        # after the engine: vLLM and DeepSpeed each set up torch.distributed's default group if none exists,
        # and two threads doing it at once collide (one process group of world size 1 serves both)
        self._await_ready()
        import torch

        if torch.cuda.is_available():
            self._learner_stream = torch.cuda.Stream()  # non-blocking: no implicit wait on the engine's
        with self._on_learner_stream():
            return self._learner.setup(address, self._engine_weights())

    def _engine_weights(self) -> tuple[dict, dict]:
        """The engine's weights that no publish rewrites, and its packed layers: the learner's frozen base reads them
        where they equal its own (learner/shared_weights.py). ({}, {}) where the engine gives none."""
        frozen = getattr(self.engine, "frozen_weights", None)  # a vLLM engine's (model.fast_inference)
        if frozen is None:
            return {}, {}
        try:
            return frozen()
        except Exception as e:  # noqa: BLE001 - an engine that cannot say leaves the learner its own weights
            print(f"ColocatedWorker: the engine's weights are not shared with the learner ({type(e).__name__}: "
                  f"{str(e)[:200]}): the learner holds its own", flush=True)
            return {}, {}

    @contextlib.contextmanager
    def _on_learner_stream(self):
        """The learner's work on its own stream, finished before the call returns: what it hands over (an
        adapter, a checkpoint) is complete, and nothing of it runs on when the engine's stream reads it."""
        if self._learner_stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self._learner_stream):
            yield
        self._learner_stream.synchronize()


forward_learner_methods(ColocatedWorker, holder="_learner", prefix=PREFIX, around="_on_learner_stream")


def colocated_actor_class(cfg):
    """ColocatedWorker as a threaded Ray actor asking for a rollout worker's and a learner rank's resources
    together (one node must hold both), with both roles' environment; one call thread more than a rollout
    worker's, for the learner's calls."""
    import ray

    c = cfg.cluster
    need = colocated_request(cfg)
    r, lr = c.rollout_resources, c.learner_resources
    # each role's kernels on as many threads as its own actor would run them (Ray sets OMP_NUM_THREADS to an
    # actor's num_cpus): with the sum, the engine's and the learner's thread teams oversubscribe the cores
    # (the CPU benchmark's job at 8 completions: 0.38 -> 0.21 s a step with max_staleness 0)
    threads = str(max(1, int(min(r.num_cpus, lr.num_cpus))))
    env = {**learner_env_vars(lr.num_gpus > 0), **rollout_env_vars(r.num_gpus), **COLOCATED_ENV,
           "OMP_NUM_THREADS": threads}
    return ray.remote(num_cpus=need.pop("CPU", 0.0), num_gpus=need.pop("GPU", 0.0), resources=need or None,
                      runtime_env={"env_vars": env}, max_concurrency=call_threads(cfg) + 1)(ColocatedWorker)


def worker_starter(cfg, host=None):
    """start_worker(slot) for the RolloutPool: the colocated actor `host` for the first start (its setup
    starts the engine), plain rollout workers for every other slot and for any replacement."""
    hosts = [host] if host is not None else []

    def start(slot: int):
        if hosts:
            h = hosts.pop()
            return h, h.setup.remote()
        return start_rollout_worker(cfg, slot)
    return start


def start_actors(cfg, total_steps: int, counters, say):
    """The job's learner group and rollout pool, the learner's setup running while the rollout workers start
    (colocate: rank 0's actor is worker 0). -> (LearnerGroup, RolloutPool); where one fails to start, both are stopped
    before the error is raised."""
    from tandem.core.checks import write_shared_probe
    from tandem.core.engine_memory import prompts_in_flight
    from tandem.core.storage import Store
    from tandem.learner.group import LearnerGroup
    from tandem.services.orchestrator.rollout_pool import RolloutPool

    probe, learner, pool = write_shared_probe(cfg.logging.output_dir), None, None
    try:
        colocate = cfg.cluster.vllm_mode == "colocate"
        host = dict(actor_class=colocated_actor_class(cfg), prefix=PREFIX) if colocate else {}
        learner = LearnerGroup(cfg, total_steps=total_steps, probe=probe, wait=False, **host)
        start = worker_starter(cfg, host=learner.actors[0] if colocate else None)
        pool = RolloutPool(start, prompts_in_flight(cfg), counters, max_worker_restarts=cfg.cluster.max_worker_restarts,
                           say=say, request=f"cluster.rollout_resources = {cfg.cluster.rollout_resources.model_dump()}")
        pool.start(cfg.cluster.num_rollout_workers)
        learner.ready()
        return learner, pool
    except BaseException:  # a learner that cannot start (a refused job): nothing of the job is left running
        if pool is not None:
            pool.shutdown()
        if learner is not None:
            learner.shutdown()
        raise
    finally:
        Store(probe).delete()
