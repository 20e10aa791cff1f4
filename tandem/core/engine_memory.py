"""What a rollout engine holds on its GPU, from the job and the model's config alone: the sequences the controller
keeps in it, their KV cache at full length, the weights. `cluster.vllm_gpu_memory_utilization: auto` sizes vLLM's
KV cache by it (rollout/engines/vllm_engine.py) and a learner sharing the GPU counts it as taken (learner/memory.py).
Pure arithmetic; both sides import it from here so they agree."""

from __future__ import annotations

from tandem.core.plan import BatchPlan

GIB = 1 << 30
# Beyond weights and KV cache: CUDA graphs, the profile run's activations (max_num_batched_tokens of them), the
# sampler's logits for a full batch, LoRA slots, the allocator's slack, and the CUDA context vLLM does not count. vLLM
# counted 4.06 GiB of the first five at 7B (CUDA graphs 0.94) and 3.69 at 1.5B (0.75) within 0.3 of an H200
# (bench/results/e2e_gpu_scale_raw/h200/2026-12-03-bafd0fc/*/log-vllm_ceiling*.txt: the share less "Model loading
# took" and "Available KV cache memory"); the 7B engine process held 5.18 GiB beyond weights and KV cache in all, at
# either KV size (nvidia-smi's per-process peak on one H100: e2e_gpu_scale_raw/h100/2026-12-05-2efb84c/7b/).
ENGINE_OVERHEAD = 5 * GIB
SHARE_WITHOUT_SHAPE = 0.3  # auto where the model's config does not say its shape: TRL's colocate default
# Sequences in flight where an engine's decode stops gaining throughput (its plateau): on one H200 serving a LoRA
# adapter at Qwen2.5-1.5B's shape, 256 sequences make 1.19x the tokens a second of 128 and 512 make less
# (bench/results/plateau_gpu.md); decode turns from reading the weights to computing near peak FLOPs x bytes per
# weight / (2 x memory bandwidth) sequences, ~200 on an H200 in bf16 whatever the model's size. On a CPU, vLLM's
# own default batch.
PLATEAU_SEQUENCES = {"gpu": 256, "cpu": 128}


def prompts_in_flight(cfg) -> int:
    """Prompts the controller keeps at most in each worker's engine: `cluster.rollout_prompts_in_flight`, or as
    many groups as reach the engine's plateau (`plateau_prompts`) and the over-sampled ones; for a job whose episodes
    call tools, as many as the staleness bound lets out: an episode waiting on a tool holds no sequence in the
    engine, so episodes counted against the plateau would leave it idle (bench/results/agentic_gpu.md: a tool-bound
    run's engine was busy 0.40 of the time on one H100). The staleness bound may keep fewer there
    (services/orchestrator/pipeline.py: k + 1 batches outstanding at most)."""
    c = cfg.cluster
    if c.rollout_prompts_in_flight is not None:
        return c.rollout_prompts_in_flight
    if episodes_call_tools(cfg):
        return prompts_ahead(cfg)
    return plateau_prompts(cfg) + oversample_prompts(cfg)


def prompts_ahead(cfg) -> int:
    """The most prompts the controller hands out ahead: max_staleness + 1 cycles' unique_prompts, and the
    over-sampled ones (services/orchestrator/pipeline.py)."""
    c = cfg.cluster
    return BatchPlan.from_config(cfg).unique_prompts * (c.max_staleness + 1) + oversample_prompts(cfg)


def in_flight(cfg) -> bool:
    """A published version reaches the requests already sampling (cluster.inflight_updates at max_staleness >= 1, on
    vLLM): no group is stopped or dropped for staleness, the learner masks the tokens too old for it."""
    c = cfg.cluster
    return c.inflight_updates and c.max_staleness >= 1 and cfg.model.fast_inference


def token_lag_bound(cfg) -> int | None:
    """In flight, the most versions a trained token may lag the weights that train on it (`cluster.max_token_lag`;
    null = max_staleness + 1: the k batches the bound lets ahead, plus the one publish that a sequence still
    sampling when its batch is taken may have crossed); None where the controller bounds whole groups."""
    if not in_flight(cfg):
        return None
    c = cfg.cluster
    return c.max_staleness + 1 if c.max_token_lag is None else c.max_token_lag


def oversample_prompts(cfg) -> int:
    """Prompts out beyond the staleness bound (`cluster.rollout_oversample_prompts`): as set, or for auto as many as
    keep the plateau's prompts out while a batch trains. Then the bound lets out max_staleness batches, and at a long
    tail most of those places are held by groups the bound will stop (at max_staleness 1, 13-16 of a batch's 16 at the
    1.5B long tail: bench/results/e2e_gpu_scale.md), so the next batch is sampled after the training, not beside it.
    None at max_staleness 0 (a synchronous cycle trains all it hands out), with in-flight updates (no group is
    stopped: cluster.inflight_updates), with tools (the bound lets out every
    episode the engine can hold already: `prompts_in_flight`), or on a CPU, whose engine has no plateau: each
    sequence more slows the others, so the over-sampled prompts make every group slower to come back
    (bench/results/pipeline_cpu.md: 12 over-sampled at k = 1 on a 2-core CPU sent 10 of 32 prompts twice past the bound
    within five cycles; 4 gave 0.8 x the completions a second)."""
    c = cfg.cluster
    if c.rollout_oversample_prompts != "auto":
        return c.rollout_oversample_prompts
    if c.max_staleness == 0 or in_flight(cfg) or episodes_call_tools(cfg) or c.rollout_resources.num_gpus == 0:
        return 0
    return max(0, plateau_prompts(cfg) - BatchPlan.from_config(cfg).unique_prompts * c.max_staleness)


def plateau_prompts(cfg) -> int:
    """Groups whose sequences reach the engine's plateau: `vllm_max_num_seqs`, else PLATEAU_SEQUENCES, over
    num_generations."""
    c = cfg.cluster
    seqs = c.vllm_max_num_seqs or PLATEAU_SEQUENCES["gpu" if c.rollout_resources.num_gpus > 0 else "cpu"]
    return max(1, seqs // cfg.batch.num_generations)


def episodes_call_tools(cfg) -> bool:
    """Episodes of several turns with tool calls between them (`tools:` or `environment:`)."""
    return bool(cfg.tools) or cfg.environment is not None


def sequences_in_engine(cfg, default_max: int | None = None) -> int:
    """The most sequences one engine runs at once: the controller's prompts in flight, and never more than
    the prompts it hands out ahead (`prompts_ahead`), times the group size; with tools, or with over-sampled prompts,
    no more than the plateau's (between turns an episode holds none; the over-sampled prompts stand in for groups
    whose other sequences have finished, and past the plateau vLLM queues them: `engine_max_num_seqs`); no more than
    `vllm_max_num_seqs` (or `default_max` where that is not set; vLLM queues the rest)."""
    held = prompts_in_flight(cfg)
    if episodes_call_tools(cfg) or over_sampled_queue(cfg):
        held = min(held, plateau_prompts(cfg))
    seqs = min(held, prompts_ahead(cfg)) * cfg.batch.num_generations
    m = cfg.cluster.vllm_max_num_seqs or default_max
    return min(seqs, m) if m else seqs


def over_sampled_queue(cfg) -> bool:
    """Over-sampled prompts beside the plateau's (`rollout_prompts_in_flight` left to it): past the plateau they wait
    in vLLM's queue, not in its KV cache."""
    c = cfg.cluster
    return bool(oversample_prompts(cfg)) and c.rollout_prompts_in_flight is None


def engine_max_num_seqs(cfg) -> int | None:
    """vLLM's max_num_seqs: `vllm_max_num_seqs` as set; with over-sampled prompts, the sequences its KV cache is
    sized for (`sequences_in_engine`), so that the prompts beyond them wait in vLLM's queue rather than take
    blocks a running sequence will need (a preemption); else None (vLLM's default). At the 1.5B long tail the engine
    ran 206-222 sequences a step with 8 or 16 prompts over-sampled, under the plateau's 256, while a KV cache sized
    for all of them at full length took 3.5-7 GiB more (bench/results/e2e_gpu_scale.md, the df90fa1 lease)."""
    if cfg.cluster.vllm_max_num_seqs or not over_sampled_queue(cfg):
        return cfg.cluster.vllm_max_num_seqs
    return sequences_in_engine(cfg)


def head_dim(mc: dict) -> int:
    """One attention head's width: config.json's head_dim where it says one (Qwen3, Gemma), else hidden / heads."""
    return mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]


def kv_bytes_per_token(mc: dict, dtype_bytes: int) -> int:
    """K and V of one token over all layers."""
    heads = mc["num_attention_heads"]
    return 2 * mc["num_hidden_layers"] * (mc.get("num_key_value_heads") or heads) * head_dim(mc) * dtype_bytes


def weight_bytes(mc: dict, dtype_bytes: int) -> int:
    """A Llama-family decoder's parameters (embedding, an untied lm_head, attention with the biases its config gives,
    a gated MLP, two norms per layer and the final one) times the bytes of one."""
    h, V, L = mc["hidden_size"], mc["vocab_size"], mc["num_hidden_layers"]
    heads = mc["num_attention_heads"]
    kv = mc.get("num_key_value_heads") or heads
    hd = head_dim(mc)
    inter = mc.get("intermediate_size") or 4 * h
    # Qwen2: biases on q, k, v; Llama's attention_bias: on o too
    bias = (heads + 2 * kv) * hd + h if mc.get("attention_bias") else \
        (heads + 2 * kv) * hd if mc.get("model_type") == "qwen2" else 0
    layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + bias + 3 * h * inter + 2 * h
    head = 0 if mc.get("tie_word_embeddings", True) else V * h
    return (V * h + head + L * layer + h) * dtype_bytes


def engine_kv_bytes(cfg, mc: dict, default_max: int | None = None) -> int:
    """A KV cache holding every sequence the engine runs at once at full length (max_prompt_length +
    max_completion_length): vLLM then never preempts one, and holds nothing it could not use."""
    g = cfg.generation
    return kv_bytes_per_token(mc, _dtype_bytes(cfg)) * sequences_in_engine(cfg, default_max) * \
        (g.max_prompt_length + g.max_completion_length)


def auto_engine(cfg, mc: dict | None) -> tuple[int, int] | None:
    """`vllm_gpu_memory_utilization: auto`'s sizes: (the KV cache, weights + KV cache + ENGINE_OVERHEAD) in bytes;
    None where the model's config does not say its shape (auto then takes SHARE_WITHOUT_SHAPE)."""
    try:
        kv = engine_kv_bytes(cfg, mc)
        return kv, weight_bytes(mc, _dtype_bytes(cfg)) + kv + ENGINE_OVERHEAD
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def engine_bytes(cfg, mc: dict | None, total: int) -> int:
    """What one rollout engine takes of a GPU of `total` bytes: the share set in `vllm_gpu_memory_utilization`, or
    (auto) `auto_engine`'s, or SHARE_WITHOUT_SHAPE of a model whose shape is unknown."""
    share = cfg.cluster.vllm_gpu_memory_utilization
    auto = auto_engine(cfg, mc) if share == "auto" else None
    if auto is not None:
        return auto[1]
    return int((SHARE_WITHOUT_SHAPE if share == "auto" else share) * total)


def _dtype_bytes(cfg) -> int:
    return 4 if cfg.model.dtype == "float32" else 2
