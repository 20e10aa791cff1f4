"""model.gradient_checkpointing: auto. The per-token activation estimate against what autograd really saves for
backward in a real Qwen2 with LoRA on every linear layer (counted through saved-tensor hooks), and the decision
against the arithmetic written out."""

import os

import pytest
import torch

from tandem.learner.memory import GIB, activation_bytes_per_token, checkpointing_needed, learner_budget


def saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward (the parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits[:, -1].sum()
    return sum(seen.values())


@pytest.mark.parametrize("layers", [2, 4])
def test_the_activation_estimate_is_what_autograd_keeps_within_a_fifth(tmp_path, layers):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tandem.services.devtools.tiny_model import build_tiny_model

    d = build_tiny_model(tmp_path / f"m{layers}", layers=layers, hidden=256, heads=4, kv_heads=2, intermediate=768,
                         vocab=512)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM")).train()
    T = 64
    ids = torch.randint(0, 512, (1, T))
    per_token = (saved_bytes(model, ids) - saved_bytes(model, ids[:, : T // 2])) / (T - T // 2)  # the head's
    est = activation_bytes_per_token(model.config.to_dict(), 4)  # fixed costs cancel in the difference
    assert est / 1.2 < per_token < est * 1.2, (per_token, est)  # 0.95 and 0.94 measured


def test_checkpointing_turns_on_where_the_largest_micro_batch_would_not_fit():
    qwen_1_5b = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
                 "num_hidden_layers": 28}
    per = activation_bytes_per_token(qwen_1_5b, 2)
    assert per == (7 * 1536 + 3 * 256 + 4 * 8960) * 28 * 2
    # one H200 shared with an engine taking 0.3 of it, the learner holding 4 GiB: 8 x 2,112 tokens fit, 40 x 2,112 not
    budget = learner_budget(140 * GIB, 4 * GIB, int(0.3 * 140 * GIB))
    assert budget == 140 * GIB - int(0.3 * 140 * GIB) - 6 * GIB
    assert not checkpointing_needed(per, 8 * 2112, budget)
    assert checkpointing_needed(per, 40 * 2112, budget)
    assert checkpointing_needed(per, 8 * 2112, learner_budget(24 * GIB, 4 * GIB, int(0.3 * 24 * GIB)))  # a 24 GiB card


QWEN_1_5B = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
             "num_hidden_layers": 28}


def job(rollout_gpus, per=8, mode="server", share=0.6, **model):
    from tandem.core.config import JobConfig

    return JobConfig.from_dict({
        "model": {"path": "m", "lora": {"r": 16}, **model}, "data": {"path": "d.jsonl"}, "rewards": ["r:f"],
        "generation": {"max_prompt_length": 64, "max_completion_length": 2048},
        "batch": {"per_device_train_batch_size": per, "gradient_accumulation_steps": 1, "num_generations": 8},
        "cluster": {"vllm_mode": mode, "vllm_gpu_memory_utilization": share,
                    "rollout_resources": {"num_gpus": rollout_gpus}, "learner_resources": {"num_gpus": 0.4}}})


def test_auto_checkpointing_reads_the_job_the_engine_share_and_an_unknown_shape():
    """A padded learner (one forward per plan micro-batch): checkpointing where the largest micro-batch won't fit."""
    from tandem.learner.memory import forward_layout

    mc, total, held = QWEN_1_5B, 140 * GIB, 4 * GIB
    layout = lambda cfg, shape=mc: forward_layout(cfg, shape, False, (total, held))
    per = activation_bytes_per_token(mc, 2) * 8 * 2112  # 8 sequences at 64 + 2,048 tokens: ~41 GiB
    # an engine on the same GPU takes 0.6 of it: 56 - 6 GiB left, 41 > 3/4 of that
    assert per > 0.75 * (int(total * 0.4) - 6 * GIB)
    assert layout(job(0.4)) == (None, True)
    assert layout(job(1)) == (None, False)  # the engine on a GPU of its own
    assert layout(job(1, mode="colocate")) == (None, True)  # colocated: in this process's GPU
    assert layout(job(1, per=32)) == (None, True)  # 32 sequences: ~165 GiB
    assert layout(job(1), {"hidden_size": 1536}) == (None, True)  # shape unknown: on, as TRL
    assert layout(job(0.4, gradient_checkpointing=False)) == (None, False)  # the user's word stands


def test_auto_tokens_per_forward_fill_what_is_left_and_checkpoint_only_where_one_sequence_cannot_fit():
    from tandem.learner.memory import (
        ACTIVATION_SHARE,
        MAX_AUTO_TOKENS,
        MIN_FAST_TOKENS,
        SHARED_GPU_SHARE,
        checkpointed_bytes_per_token,
        forward_layout,
    )

    mc, held = QWEN_1_5B, 4 * GIB
    full, kept = activation_bytes_per_token(mc, 2), checkpointed_bytes_per_token(mc, 2)
    assert kept == 1536 * 28 * 2 + full // 28
    # one H200 beside an engine taking 0.6: 50 GiB left, 3/4 of it more than ACTIVATION_SHARE of the device (22 GiB):
    # ~9k tokens without checkpointing (the engine's 84 GiB leave less than that of SHARED_GPU_SHARE)
    room = 140 * GIB - int(140 * GIB * 0.6) - held - 2 * GIB
    assert 0.75 * room > ACTIVATION_SHARE * 140 * GIB
    tokens, ck = forward_layout(job(0.4), mc, True, (140 * GIB, held))
    assert (tokens, ck) == (int(ACTIVATION_SHARE * 140 * GIB // full), False) and 8_192 < tokens < 10_000
    # alone on its GPU (no engine): SHARED_GPU_SHARE of it, ~18k tokens, capped
    assert SHARED_GPU_SHARE * 140 * GIB // full > MAX_AUTO_TOKENS
    assert forward_layout(job(1), mc, True, (140 * GIB, held)) == (MAX_AUTO_TOKENS, False)
    # an engine taking 0.75: 3/4 of the 29 GiB left binds, ~8.8k tokens
    room = 140 * GIB - int(140 * GIB * 0.75) - held - 2 * GIB
    assert 0.75 * room < ACTIVATION_SHARE * 140 * GIB
    assert forward_layout(job(0.4, share=0.75), mc, True, (140 * GIB, held)) == (int(0.75 * room // full), False)
    # a model of half the width: more would fit, the cap holds
    half = {**mc, "hidden_size": 768, "intermediate_size": 4480}
    assert ACTIVATION_SHARE * 140 * GIB // activation_bytes_per_token(half, 2) > MAX_AUTO_TOKENS
    assert forward_layout(job(0.4), half, True, (140 * GIB, held)) == (MAX_AUTO_TOKENS, False)
    # a 24 GiB card beside the engine: 3.6 GiB left, not one 2,112-token sequence without checkpointing
    room = 24 * GIB - int(24 * GIB * 0.6) - held - 2 * GIB
    assert 0.75 * room < full * 2112
    assert forward_layout(job(0.4), mc, True, (24 * GIB, held)) == (int(0.75 * room // kept), True)
    # a 40 GiB card beside the engine: 10 GiB left, ~2,900 tokens without checkpointing: fewer than MIN_FAST_TOKENS,
    # so checkpointed forwards of up to MAX_AUTO_TOKENS instead (measured faster)
    room = 40 * GIB - int(40 * GIB * 0.6) - held - 2 * GIB
    assert 2112 < 0.75 * room // full < MIN_FAST_TOKENS
    assert forward_layout(job(0.4), mc, True, (40 * GIB, held)) == (min(int(0.75 * room // kept), MAX_AUTO_TOKENS), True)
    # checkpointing asked for: the tokens that fit that way; refused: never below one whole sequence
    assert forward_layout(job(0.4, gradient_checkpointing=True), mc, True, (140 * GIB, held))[1] is True
    assert forward_layout(job(0.4, gradient_checkpointing=False), mc, True, (24 * GIB, held)) == (2112, False)
    # a budget set by hand: kept, checkpointing decided for it
    assert forward_layout(job(0.4, max_tokens_per_forward=4096), mc, True, (140 * GIB, held)) == (4096, False)
    assert forward_layout(job(0.4, max_tokens_per_forward=30000), mc, True, (140 * GIB, held)) == (30000, True)
    # off a GPU: the plan's largest micro-batch (8 x 2,112), no checkpointing; null: the plan's micro-batches
    assert forward_layout(job(1), mc, True, None) == (8 * 2112, False)
    assert forward_layout(job(1, max_tokens_per_forward=None), mc, True, None) == (None, False)
    assert forward_layout(job(1), mc, False, None) == (None, False)  # padded: no regrouping


QWEN_7B = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
           "num_hidden_layers": 28}


def test_a_wider_model_skips_checkpointing_at_fewer_tokens():
    """7B on an H200 beside its engine: ~5k tokens fit without checkpointing, fewer than 1.5B's MIN_FAST_TOKENS but
    more than the width-scaled threshold (a 7B token's matmuls are 2.3x as wide): no checkpointing (the 2026-12-03 run (e9191cf)
    measured 4,096-token forwards so faster than checkpointed 16,384-token ones)."""
    from tandem.learner.memory import ACTIVATION_SHARE, MIN_FAST_TOKENS, forward_layout, min_fast_tokens

    assert min_fast_tokens(QWEN_1_5B) == MIN_FAST_TOKENS
    assert min_fast_tokens({**QWEN_1_5B, "hidden_size": 768}) == MIN_FAST_TOKENS  # never more than at 1.5B
    assert min_fast_tokens(QWEN_7B) == MIN_FAST_TOKENS * 1536 // 3584 == 3510
    full, total, held = activation_bytes_per_token(QWEN_7B, 2), 140 * GIB, 16 * GIB
    tokens, ck = forward_layout(job(0.4), QWEN_7B, True, (total, held))
    assert (tokens, ck) == (int(ACTIVATION_SHARE * total // full), False) and 3510 < tokens < MIN_FAST_TOKENS
    # the same model on an 80 GiB card beside the engine: ~2.6k tokens, under the 7B threshold: checkpointed
    tokens, ck = forward_layout(job(0.4), QWEN_7B, True, (80 * GIB, held))
    assert ck is True and tokens > 3510


def test_max_tokens_per_forward_refuses_zero():
    with pytest.raises(Exception, match="model.max_tokens_per_forward = 0"):
        job(1, max_tokens_per_forward=0)


def test_a_gpu_learner_grows_its_allocator_segments_unless_the_job_says_otherwise(monkeypatch):
    """The learner's forwards change size; fixed segments keep blocks the next forward does not fit (tandem/core/
    compat.py). A setting of the job's own stands; a CPU learner is left alone; off a GPU no peaks are reported."""
    from tandem.core.compat import GPU_ALLOCATOR, learner_env_vars
    from tandem.learner.metrics import memory_peaks, process_gpu_bytes

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert learner_env_vars(True)["PYTORCH_CUDA_ALLOC_CONF"] == GPU_ALLOCATOR == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in learner_env_vars(False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert learner_env_vars(True)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert memory_peaks("cpu") == {}
    if not torch.cuda.is_available():
        assert process_gpu_bytes() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: bench/device/cuda_tests.sh")
def test_a_gpu_learner_reports_what_its_process_holds_beyond_torchs_allocator():
    """learner/outside_allocator_gib: the driver's count for the process (NVML) less torch's reserve; a CUDA context
    alone is over 64 MiB, so a wrong sign or the whole GPU's use (every process) breaks the bounds."""
    from tandem.learner.metrics import memory_peaks, process_gpu_bytes

    x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB in torch's allocator
    held = process_gpu_bytes()
    assert held is not None and held >= torch.cuda.memory_reserved() + (64 << 20), (held, torch.cuda.memory_reserved())
    assert 1 / 16 < memory_peaks("cuda")["learner/outside_allocator_gib"] < 4
    assert process_gpu_bytes(os.getppid()) is None  # the shell that started pytest holds nothing on a GPU
    del x
