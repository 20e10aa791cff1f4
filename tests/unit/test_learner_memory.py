"""model.gradient_checkpointing: auto. The per-token activation estimate against what autograd really saves for
backward in a real Qwen2 with LoRA on every linear layer (counted through saved-tensor hooks), and the decision
against the arithmetic written out."""

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
    budget = learner_budget(140 * GIB, 4 * GIB, 0.3)
    assert budget == int(140 * GIB * 0.7) - 6 * GIB
    assert not checkpointing_needed(per, 8 * 2112, budget)
    assert checkpointing_needed(per, 40 * 2112, budget)
    assert checkpointing_needed(per, 8 * 2112, learner_budget(24 * GIB, 4 * GIB, 0.3))  # a 24 GiB card


def test_auto_reads_the_job_the_engine_share_and_an_unknown_shape():
    from tandem.core.config import JobConfig
    from tandem.learner.memory import auto_checkpointing

    def cfg(rollout_gpus, per=8, mode="server"):
        return JobConfig.from_dict({
            "model": {"path": "m", "lora": {"r": 16}}, "data": {"path": "d.jsonl"}, "rewards": ["r:f"],
            "generation": {"max_prompt_length": 64, "max_completion_length": 2048},
            "batch": {"per_device_train_batch_size": per, "gradient_accumulation_steps": 1, "num_generations": 8},
            "cluster": {"vllm_mode": mode, "vllm_gpu_memory_utilization": 0.6,
                        "rollout_resources": {"num_gpus": rollout_gpus}, "learner_resources": {"num_gpus": 0.4}}})
    mc = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
          "num_hidden_layers": 28}
    per = activation_bytes_per_token(mc, 2) * 8 * 2112  # 8 sequences at 64 + 2,048 tokens: ~41 GiB
    total, held = 140 * GIB, 4 * GIB
    # an engine on the same GPU takes 0.6 of it: 56 - 6 GiB left, 41 > 3/4 of that
    assert auto_checkpointing(cfg(0.4), mc, total, held) == (per > 0.75 * (int(total * 0.4) - 6 * GIB)) is True
    assert auto_checkpointing(cfg(1), mc, total, held) is False  # the engine on a GPU of its own
    assert auto_checkpointing(cfg(1, mode="colocate"), mc, total, held) is True  # colocated: in this process's GPU
    assert auto_checkpointing(cfg(1, per=32), mc, total, held) is True  # 32 sequences: ~165 GiB
    assert auto_checkpointing(cfg(1), {"hidden_size": 1536}, total, held) is True  # shape unknown: on, as TRL
