"""`model.gradient_checkpointing: auto`: recompute activations only where the largest micro-batch's would not fit
the learner's GPU memory. Pure arithmetic on the model's config and the device's numbers; the learner asks it once,
after DeepSpeed placed the model (learner/actor.py)."""

from __future__ import annotations

GIB = 1 << 30


def activation_bytes_per_token(mc: dict, dtype_bytes: int) -> int:
    """What a decoder keeps for backward per token without checkpointing, over all layers: per layer the inputs the
    backward reads (two norms' inputs and outputs, q/k/v, the rotated q/k, the attention's output; the MLP's gate,
    up, activation and down inputs): ~7 hidden + 3 KV + 4 intermediate elements (LoRA's rank-r intermediates and
    FlashAttention's per-row statistics are small beside them)."""
    h = mc["hidden_size"]
    heads = mc["num_attention_heads"]
    kv = mc.get("num_key_value_heads") or heads
    head_dim = mc.get("head_dim") or h // heads
    inter = mc.get("intermediate_size") or 4 * h
    return (7 * h + 3 * kv * head_dim + 4 * inter) * mc["num_hidden_layers"] * dtype_bytes


def learner_budget(total: int, allocated: int, engine_share: float, margin: int = 2 * GIB) -> int:
    """Bytes left for activations: the device's memory less what a vLLM engine sharing it takes (its
    gpu_memory_utilization share of the total, whether or not it has started yet), less what the learner already
    holds (weights, optimizer state), less a margin for the allocator and the loss's chunks."""
    return int(total * (1 - engine_share)) - allocated - margin


def checkpointing_needed(per_token: int, tokens: int, budget: int, headroom: float = 0.75) -> bool:
    """True where `tokens` tokens' activations would take more than `headroom` of the budget."""
    return per_token * tokens > headroom * budget


def auto_checkpointing(cfg, mc: dict | None, total: int, allocated: int) -> bool:
    """`model.gradient_checkpointing: auto` on a GPU of `total` bytes where the learner holds `allocated`: on where the
    largest micro-batch (per_device_train_batch_size sequences at max_prompt_length + max_completion_length) would
    not fit; on where the model's shape is unknown (`mc` None or short of a key), as TRL's default is."""
    c, g = cfg.cluster, cfg.generation
    shares = cfg.model.fast_inference and (c.vllm_mode == "colocate" or 0 < c.rollout_resources.num_gpus < 1)
    tokens = cfg.batch.per_device_train_batch_size * (g.max_prompt_length + g.max_completion_length)
    try:
        per_token = activation_bytes_per_token(mc, 4 if cfg.model.dtype == "float32" else 2)
    except (KeyError, TypeError, ZeroDivisionError):
        return True
    return checkpointing_needed(per_token, tokens,
                                learner_budget(total, allocated, c.vllm_gpu_memory_utilization if shares else 0.0))
