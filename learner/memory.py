"""`model.max_tokens_per_forward: auto` and `model.gradient_checkpointing: auto`: forwards as large as the learner's
GPU memory takes, activations recomputed only where they would not fit. Pure arithmetic on the model's config and the
device's numbers; the learner asks it once, after DeepSpeed placed the model (learner/actor.py)."""

from __future__ import annotations

from tandem.core.engine_memory import engine_bytes, head_dim

GIB = 1 << 30


def activation_bytes_per_token(mc: dict, dtype_bytes: int) -> int:
    """What a decoder keeps for backward per token without checkpointing, over all layers: per layer the inputs the
    backward reads (two norms' inputs and outputs, q/k/v, the rotated q/k, the attention's output; the MLP's gate,
    up, activation and down inputs): ~7 hidden + 3 KV + 4 intermediate elements (LoRA's rank-r intermediates and
    FlashAttention's per-row statistics are small beside them)."""
    h = mc["hidden_size"]
    heads = mc["num_attention_heads"]
    kv = mc.get("num_key_value_heads") or heads
    inter = mc.get("intermediate_size") or 4 * h
    return (7 * h + 3 * kv * head_dim(mc) + 4 * inter) * mc["num_hidden_layers"] * dtype_bytes


def learner_budget(total: int, allocated: int, engine: int, margin: int = 2 * GIB) -> int:
    """Bytes left for activations: the device's memory less what a vLLM engine sharing it takes (`engine` bytes,
    whether or not it has started yet: tandem/core/engine_memory.py), less what the learner already holds
    (weights, optimizer state), less a margin for the allocator and the loss's chunks."""
    return total - engine - allocated - margin


def checkpointing_needed(per_token: int, tokens: int, budget: int, headroom: float = 0.75) -> bool:
    """True where `tokens` tokens' activations would take more than `headroom` of the budget."""
    return per_token * tokens > headroom * budget


def checkpointed_bytes_per_token(mc: dict, dtype_bytes: int) -> int:
    """The same with gradient checkpointing: each layer's input kept, one layer's activations alive in its
    recompute."""
    return mc["hidden_size"] * mc["num_hidden_layers"] * dtype_bytes + \
        activation_bytes_per_token(mc, dtype_bytes) // mc["num_hidden_layers"]


# Longer forwards gain little (bench/results/learner_gpu.md, the 2026-12-03 run (e7b5564): ~10k tokens per forward 0.363 learner/mfu,
# ~20k 0.374) and hold more memory (48 against 83 GiB there).
MAX_AUTO_TOKENS = 16384
# Below this many tokens a forward without checkpointing is slower than a checkpointed one of MAX_AUTO_TOKENS (there:
# ~5k tokens 0.234 learner/mfu, ~20k checkpointed 0.285): auto checkpoints rather than shrink the forwards further.
# Measured at 1.5B's width (MIN_FAST_WIDTH); a wider model does more work per token in each of its matmuls, so fewer
# tokens fill them (min_fast_tokens): at 7B (3,584) 4,096-token forwards without checkpointing made a colocated step
# 15.6 s against 18.0 s with checkpointed 16,384-token ones (bench/results/e2e_gpu_scale.md, the 2026-12-03 run (e9191cf)).
MIN_FAST_TOKENS = 8192
MIN_FAST_WIDTH = 1536


def min_fast_tokens(mc: dict) -> int:
    """The fewest tokens a forward without checkpointing takes before auto checkpoints instead: MIN_FAST_TOKENS at
    MIN_FAST_WIDTH, inversely with the model's hidden size, never more than MIN_FAST_TOKENS."""
    return min(MIN_FAST_TOKENS, MIN_FAST_TOKENS * MIN_FAST_WIDTH // mc["hidden_size"])


# auto's activations take at least this share of the device, whatever is free, and where the engine beside them is
# small the two together take SHARED_GPU_SHARE: a peak at or below TRL's beside the same workload. The lower peer is
# TRL's AsyncGRPOTrainer (its server at 0.3 of the device, its trainer beside it): on one H200 at the 1.5B long tail it
# peaked at 48.5-48.8 GiB, Tandem at 0.2 and 0.34 at 50.7 (k=1: the learner 28.5 GiB, 11,319-token forwards without
# checkpointing, beside a 22.3 GiB engine; bench/results/e2e_gpu_scale.md, the 2026-12-06 run (b055745)). At 0.16 and
# 0.32 the k=1 learner's forwards hold ~9.2k tokens (~5 GiB less, still without checkpointing: computed from the same
# arithmetic, not yet measured), k=0's ~12k (~13k before; learner/mfu 0.471 at ~14k against 0.411 at ~11k in the runs of
# 2026-12-03 (10868ea, c488e7f)). On an H100 the 1.5B forwards are checkpointed either way (16,384 tokens). A
# learner on a GPU of its own (no engine) takes SHARED_GPU_SHARE.
ACTIVATION_SHARE = 0.16
SHARED_GPU_SHARE = 0.32


def forward_layout(cfg, mc: dict | None, packed: bool, device: tuple[int, int] | None) -> tuple[int | None, bool]:
    """(tokens per forward, gradient checkpointing) from `model.max_tokens_per_forward` and
    `model.gradient_checkpointing`; tokens None = the plan's micro-batches, as they come. `packed`: the learner packs
    sequences (model.padding_free, and the model took it); `device`: (total, allocated) bytes of the learner's GPU
    after the model is placed, None off a GPU.

    auto tokens: on a GPU the most tokens whose activations fit both 3/4 of what is left (less what a sharing engine
    takes, `learner_budget`) and ACTIVATION_SHARE of the device (SHARED_GPU_SHARE less the engine, where that is
    more) without checkpointing, at most MAX_AUTO_TOKENS; where
    not even one sequence of max_prompt_length + max_completion_length fits, or fewer than min_fast_tokens, with
    checkpointing (auto) as many as fit that way. Off a GPU
    (or of a model whose shape is unknown) a micro-batch's worst case: per_device_train_batch_size sequences at
    full length, so a forward never holds more than the plan's largest micro-batch would.
    auto checkpointing: on where the largest forward's activations would not fit (off a GPU: off; shape unknown:
    on, as TRL's default)."""
    m, g, c = cfg.model, cfg.generation, cfg.cluster
    seq = g.max_prompt_length + g.max_completion_length
    micro = cfg.batch.per_device_train_batch_size * seq
    want, ck = m.max_tokens_per_forward, m.gradient_checkpointing
    tokens = None if not packed or want is None else (micro if want == "auto" else want)
    if device is None:
        return tokens, ck is True
    try:
        dtype_bytes = 4 if m.dtype == "float32" else 2
        full, kept = activation_bytes_per_token(mc, dtype_bytes), checkpointed_bytes_per_token(mc, dtype_bytes)
    except (KeyError, TypeError, ZeroDivisionError):
        return tokens, ck is not False
    shares = m.fast_inference and (c.vllm_mode == "colocate" or 0 < c.rollout_resources.num_gpus < 1)
    engine = engine_bytes(cfg, mc, device[0]) if shares else 0
    room = learner_budget(*device, engine)
    if packed and want == "auto":
        share = max(ACTIVATION_SHARE * device[0], SHARED_GPU_SHARE * device[0] - engine)
        fits = lambda per: min(max(int(min(0.75 * room, share) // per), 0), MAX_AUTO_TOKENS)
        if ck is False or (ck == "auto" and fits(full) >= max(seq, min_fast_tokens(mc))):
            return max(fits(full), seq), False
        return max(fits(kept), seq), True
    if ck == "auto":
        ck = checkpointing_needed(full, tokens or micro, room)
    return tokens, ck
