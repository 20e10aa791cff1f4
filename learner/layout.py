"""How a learner rank runs its forwards, decided once at setup from the model, the job and the GPU, then read-only:
whether sequences are packed, the token budget of a forward, gradient checkpointing, Liger's layers, the SMs its
matmuls leave to an engine beside them, the pad id, and what learner/mfu divides by."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.engine_memory import head_dim


@dataclass(frozen=True)
class Launch:
    """A rank's arguments, kept from the constructor to setup (torchtune's lifecycle: the actor is built cheaply,
    setup() does the work)."""
    total_steps: int
    optimizer: object  # callable(params) -> torch optimizer replacing AdamW (tests' SGD), or None
    probe: str | None  # a file the controller wrote under output_dir: setup() refuses a rank that cannot read it


@dataclass(frozen=True)
class Layout:
    packed: bool  # sequences packed back to back (the model takes packed attention), else padded
    token_budget: int | None  # tokens per forward where sequences are regrouped by length; None: the plan's rows
    checkpointing: bool  # gradient checkpointing on
    liger: bool  # Liger's layers in the model
    sm_carveout: int | None  # SMs the rank's matmuls leave to a rollout engine on its GPU (learner/sm_carveout.py)
    pad_id: int
    n_params: int  # every parameter, full sizes under ZeRO-3 (learner/mfu_6n's 6·N per token)
    peak_flops: float | None  # the GPU's dense bf16 peak; None off a known GPU
    pair_flops: int  # attention's FLOPs per (query, key) pair (0 where the shape is not known)
    matmul_params: tuple[int, int] = (0, 0)  # (every Linear layer's weights, those trained): learner/mfu's count
    engine_shared_gib: float = 0.0  # frozen weights read from a colocated engine, not held (learner/shared_weights.py)


def decide_layout(cfg, model, device, held_before: int = 0, shared: int = 0) -> Layout:
    """The layout of a rank whose model (DeepSpeed's module, on `device`) and frozen reference are placed: the token
    budget is what memory is left for activations. `held_before`: the bytes torch's allocator held in this process
    before the rank placed anything, a colocated engine's weights and KV cache (cluster.vllm_mode colocate), which
    `engine_bytes` already counts: counted twice, a colocated 7B learner on an 80 GiB GPU was left one sequence a
    forward (bench/results/e2e_gpu_scale.md, the 2026-12-05 run at 8657804). On a GPU it also sets the SM carve-out
    it reports (process-wide: learner/sm_carveout.py). `shared`: the bytes of frozen weights the rank reads from that
    engine (learner/shared_weights.py), which it holds no copy of."""
    from transformers import AutoTokenizer

    from tandem.core.checks import language_model_config
    from tandem.learner.memory import forward_layout
    from tandem.learner.model import checkpointing, enable_checkpointing, packs_sequences, uses_liger
    from tandem.learner.sm_carveout import apply_carveout

    cuda = device.type == "cuda"
    packed = packs_sequences(model)
    mc = language_model_config(cfg.model.local_dir()) if cuda else None  # the language model's shape
    memory = (torch.cuda.mem_get_info(device)[1], torch.cuda.memory_allocated(device) - held_before) if cuda else None
    budget, ck = forward_layout(cfg, mc, packed, memory)  # (total, this rank's own) bytes
    if ck and cfg.model.gradient_checkpointing == "auto":
        enable_checkpointing(model)
    tok = AutoTokenizer.from_pretrained(cfg.model.local_dir())
    return Layout(packed=packed, token_budget=budget, checkpointing=checkpointing(model), liger=uses_liger(model),
                  sm_carveout=apply_carveout(cfg.cluster, device) if cuda else None,
                  pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                  n_params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
                  matmul_params=matmul_params(model),
                  peak_flops=peak_flops(device), pair_flops=attention_flops_per_pair(mc),
                  engine_shared_gib=shared / 2**30)


def attention_flops_per_pair(mc: dict | None) -> int:
    """FLOPs of attention's two matmuls (scores, weighted values) per (query, key) pair, forward and backward, over all
    layers: 12·layers·heads·head_dim (verl's utils/flops_counter.py; nanoGPT's estimate_mfu: 12·L·H·Q·T per token).
    `mc`: the language model's config.json (tandem.core.checks.language_model_config); 0 where it does not say the
    shape."""
    heads, layers = (mc or {}).get("num_attention_heads"), (mc or {}).get("num_hidden_layers")
    if not heads or not layers:
        return 0
    return 12 * layers * heads * head_dim(mc)


def training_flops(n_params: int, tokens: int, pairs: int, pair_flops: int) -> int:
    """A training pass's FLOPs by the 6·N convention (verl's flops counter, nanoGPT's estimate_mfu; learner/mfu_6n):
    6 per parameter per token (N all parameters, embeddings included, and for LoRA as if the frozen weights took
    gradients too) plus attention's, `pairs` = Σ s² over the sequences (non-causal count, as both)."""
    return 6 * n_params * tokens + pair_flops * pairs


def matmul_params(model) -> tuple[int, int]:
    """(the weights of every Linear layer, the lm_head and LoRA's A and B included; those that take a gradient):
    what a token's matmuls read. An embedding is a lookup, no matmul (tied, its matrix is counted once, as the
    lm_head's)."""
    total = trained = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            n = getattr(m.weight, "ds_numel", m.weight.numel())
            total += n
            trained += n if m.weight.requires_grad else 0
    return total, trained


def step_flops(matmul: tuple[int, int], tokens: int, pairs: int, pair_flops: int, checkpointing: bool) -> int:
    """A training pass's FLOPs as it runs (learner/mfu; docs/benchmarks.md "MFU"): per token 2 per matmul weight
    forward, 2 backward for the activations' gradient, 2 more for the weights that take a gradient (LoRA: A and B,
    not the frozen base), and the forward again under gradient checkpointing; attention's two matmuls likewise (4 per
    pair forward, 8 backward, 4 recomputed). For full fine-tuning without checkpointing that is the 6·N count less
    the embeddings; for LoRA about 4·N."""
    total, trained = matmul
    again = 1 if checkpointing else 0
    per_token = (4 + 2 * again) * total + 2 * trained
    return per_token * tokens + (pair_flops + pair_flops // 3 * again) * pairs


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device) -> float | None:
    if getattr(device, "type", str(device)) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)
