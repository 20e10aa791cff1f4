"""cluster.vllm_gpu_memory_utilization: auto on a real GPU: vLLM starts with the KV cache Tandem sized, holds every
sequence the controller keeps in it at full length, takes no more of the device than the learner counts it at, and
samples. CUDA only (this CPU's engine sizes its cache by cpu_kv_cache_bytes): bench/device/cuda_tests.sh runs it on
the GPU machine."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: bench/device/cuda_tests.sh")]


def test_an_auto_engine_holds_what_the_controller_keeps_in_it_within_what_the_learner_counts(tiny_model):
    from tandem.core.checks import language_model_config
    from tandem.core.config import JobConfig
    from tandem.core.engine_memory import engine_bytes, engine_kv_bytes, sequences_in_engine
    from tandem.rollout.engines.base import Sampling
    from tandem.rollout.worker import build_engine, gpu_memory_args

    cfg = JobConfig.from_dict({
        "model": {"path": tiny_model, "dtype": "bfloat16", "lora": {"r": 8}}, "data": {"path": "d.jsonl"},
        "rewards": ["r:f"], "generation": {"max_prompt_length": 32, "max_completion_length": 96},
        "batch": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8},
        "cluster": {"rollout_resources": {"num_gpus": 1}, "vllm_enforce_eager": True}})
    mc = language_model_config(tiny_model)
    args = gpu_memory_args(cfg)
    assert args["gpu_kv_cache_bytes"] == engine_kv_bytes(cfg, mc)
    # What earlier tests in this process left in torch's caching allocator: vLLM's start empties it, which would
    # read as memory freed by the engine.
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    engine = build_engine(cfg, seed=0)
    try:
        used = free0 - torch.cuda.mem_get_info()[0]
        assert 0 < used <= engine_bytes(cfg, mc, total), (used, engine_bytes(cfg, mc, total))
        cache = engine.llm.llm_engine.vllm_config.cache_config
        assert cache.num_gpu_blocks * cache.block_size >= sequences_in_engine(cfg) * 128, cache
        out = engine.generate([np.array([1, 2, 3], dtype=np.int32)], Sampling(n=8, max_tokens=16, seed=0))
        assert len(out[0]) == 8 and all(len(c.tokens) >= 1 for c in out[0])
    finally:
        engine.close()


def test_over_sampled_prompts_wait_in_vllms_queue_past_the_plateau_and_leave_the_cache_as_it_was(tiny_model):
    """rollout_oversample_prompts at a batch whose k + 1 batches already fill the plateau (16 prompts of 8 at k = 1:
    the plateau's 32): vLLM's max_num_seqs is the plateau's sequences, the KV cache the same as without over-sampling,
    and a request for more sequences than that completes every one (queued, not preempted away). Below the plateau
    the over-sampled prompts run and take their cache (tests/unit/test_engine_memory.py)."""
    from tandem.core.checks import language_model_config
    from tandem.core.config import JobConfig
    from tandem.core.engine_memory import engine_kv_bytes, plateau_prompts, sequences_in_engine
    from tandem.rollout.engines.base import Sampling
    from tandem.rollout.worker import build_engine, gpu_memory_args

    def job(**cluster):
        return JobConfig.from_dict({
            "model": {"path": tiny_model, "dtype": "bfloat16", "lora": {"r": 8}}, "data": {"path": "d.jsonl"},
            "rewards": ["r:f"], "generation": {"max_prompt_length": 32, "max_completion_length": 96},
            "batch": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 16, "num_generations": 8},
            "cluster": {"rollout_resources": {"num_gpus": 1}, "vllm_enforce_eager": True, "max_staleness": 1,
                        "vllm_max_num_seqs": None, **cluster}})

    # over-sampling is the setting where groups finish whole (in flight none is stopped: nothing to stand in for)
    over, plain = job(rollout_oversample_prompts=16, inflight_updates=False), job(inflight_updates=False)
    assert sequences_in_engine(plain) == plateau_prompts(plain) * 8  # the premise: without it, at the plateau
    mc = language_model_config(tiny_model)
    assert engine_kv_bytes(over, mc) == engine_kv_bytes(plain, mc)
    assert gpu_memory_args(over) == gpu_memory_args(plain)
    torch.cuda.empty_cache()
    engine = build_engine(over, seed=0)
    try:
        seqs = sequences_in_engine(over)
        assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == seqs == plateau_prompts(over) * 8
        prompts = [np.array([1, 2, 3 + i], dtype=np.int32) for i in range(seqs // 8 + 16)]  # 16 groups past it
        out = engine.generate(prompts, Sampling(n=8, max_tokens=16, seed=0))
        assert len(out) == len(prompts) and all(len(g) == 8 and all(len(c.tokens) >= 1 for c in g) for g in out)
    finally:
        engine.close()


def colocated_job(tiny_model, share: float):
    """A bf16 LoRA job on the tiny model, its engine in the learner's process (vllm_mode colocate) at `share` of the
    GPU."""
    from tandem.core.config import JobConfig

    return JobConfig.from_dict({
        "model": {"path": tiny_model, "dtype": "bfloat16", "lora": {"r": 8}}, "data": {"path": "d.jsonl"},
        "rewards": ["r:f"], "generation": {"max_prompt_length": 32, "max_completion_length": 96},
        "batch": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8},
        "cluster": {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": share, "vllm_enforce_eager": True,
                    "rollout_resources": {"num_gpus": 1}}})


def test_a_colocated_learner_counts_the_engine_beside_it_once(tiny_model):
    """In one process (cluster.vllm_mode colocate) the engine's weights and KV cache are in torch's allocator when the
    learner places its model, and `engine_bytes` counts them as taken already: the learner's budget is what its own
    tensors leave. Counted twice, an engine of 0.6 of the device leaves the learner no room (one checkpointed
    sequence a forward). The layout also leaves the engine its share of the SMs (cluster.learner_sm_carveout auto)."""
    from tandem.core.checks import language_model_config
    from tandem.learner.layout import decide_layout
    from tandem.learner.memory import MAX_AUTO_TOKENS, forward_layout
    from tandem.learner.model import load_policy
    from tandem.rollout.worker import build_engine

    cfg = colocated_job(tiny_model, 0.6)
    mc = language_model_config(tiny_model)
    torch.cuda.empty_cache()
    blas = torch.backends.cuda.preferred_blas_library()
    engine = build_engine(cfg, seed=0)
    try:
        held = torch.cuda.memory_allocated()
        total = torch.cuda.mem_get_info()[1]
        assert held > 0.4 * total, (held, total)  # the engine's KV cache is in this process's allocator
        model = load_policy(cfg).to("cuda")
        layout = decide_layout(cfg, model, torch.device("cuda"), held)
        assert layout.packed
        own = torch.cuda.memory_allocated() - held
        assert (layout.token_budget, layout.checkpointing) == forward_layout(cfg, mc, True, (total, own))
        assert (layout.token_budget, layout.checkpointing) == (MAX_AUTO_TOKENS, False)
        twice = forward_layout(cfg, mc, True, (total, own + held))
        assert twice == (128, True), twice  # the old count: one full-length sequence, checkpointed
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert layout.sm_carveout == round(sms * 24 / 132) == torch._C._get_sm_carveout_experimental()
    finally:
        engine.close()
        torch._C._set_sm_carveout_experimental(None)  # process-wide: the tests after this one get every SM
        torch.backends.cuda.preferred_blas_library(blas)


def test_a_colocated_policy_reads_every_frozen_weight_from_the_engine(tiny_model):
    """On a GPU vLLM keeps the weights as loaded (packed q/k/v and gate/up): a colocated policy's frozen base is
    views of them, and placing the policy adds none of it to the process (learner/shared_weights.py)."""
    from tandem.learner.model import load_policy
    from tandem.learner.shared_weights import frozen_parameters, learner_device, share_engine_weights
    from tandem.rollout.worker import build_engine

    cfg = colocated_job(tiny_model, 0.3)
    torch.cuda.empty_cache()
    engine = build_engine(cfg, seed=0)
    try:
        model = load_policy(cfg)
        frozen = frozen_parameters(model)
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen.values())
        held = torch.cuda.memory_allocated()
        shared = share_engine_weights(model, *engine.frozen_weights(), learner_device())
        assert shared == frozen_bytes, (shared, frozen_bytes, [n for n, p in frozen.items() if p.device.type == "cpu"])
        model.to(learner_device())  # what DeepSpeed does: only the adapter is left to place
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        assert torch.cuda.memory_allocated() - held <= trainable + (4 << 20)
    finally:
        engine.close()

