"""learner/mfu's FLOP count (learner/layout.py: training_flops) against torch's own FLOP counter on a real forward and
backward, and the attention pairs it reads (learner/batch.py: attention_pairs) alike for packed and padded batches."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandem.learner.batch import attention_pairs, real_tokens
from tandem.learner.layout import attention_flops_per_pair, training_flops
from tests.unit.test_padding_free import batches


@pytest.mark.parametrize("lengths", [[96], [40, 120, 7]])
def test_the_count_is_what_torch_counts_for_a_forward_and_backward(lengths):
    # full fine-tuning (every weight takes a gradient: 6 per parameter per token), tied embeddings (the lm_head's matmul
    # counted once, as the embedding in N), eager attention: the scores and values as plain matmuls torch counts
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    counter = FlopCounterMode(display=False)
    with counter:
        for s in lengths:  # one sequence a forward: no padding for the counter to count
            model(torch.randint(0, 300, (1, s))).logits.float().sum().backward()
    counted = counter.get_total_flops()
    ours = training_flops(n_params, sum(lengths), sum(s * s for s in lengths),
                          attention_flops_per_pair(model.config.to_dict()))
    # what torch leaves out: norms and biases (parameters without a matmul), a fraction of a percent here
    assert ours == pytest.approx(counted, rel=0.01)
    # and the attention term is not negligible at these lengths: without it the count is off by more than that
    assert 6 * n_params * sum(lengths) < counted * 0.97


def test_attention_pairs_are_the_same_for_a_packed_and_a_padded_micro_batch():
    s, (padded, packed) = batches(n=3, G=4)
    lengths = [len(p) + len(c) for p, c in zip(s.prompts, s.completions)]
    assert attention_pairs(padded) == attention_pairs(packed) == sum(n * n for n in lengths)
    assert real_tokens(padded) == real_tokens(packed) == sum(lengths)


def test_a_config_without_a_shape_counts_no_attention():
    assert attention_flops_per_pair(None) == attention_flops_per_pair({"hidden_size": 64}) == 0
    assert attention_flops_per_pair(Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=3,
                                                num_key_value_heads=2).to_dict()) == 12 * 3 * 64
    assert attention_flops_per_pair({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
                                     "head_dim": 32}) == 12 * 3 * 4 * 32


@pytest.mark.parametrize("checkpointing", [False, True])
def test_learner_mfu_counts_what_a_lora_step_does_as_torch_counts_it(checkpointing):
    """learner/mfu's count (step_flops) for LoRA on every linear layer, against torch's counter on a real forward and
    backward: the frozen base takes no weight gradient (about 4·N a token, not the 6·N of learner/mfu_6n), a
    checkpointed forward runs twice. What torch does not do that the count assumes: the first layer's q, k, v read
    the embeddings, which need no gradient (their activation gradient is skipped): within 3% at 6 layers."""
    from peft import LoraConfig, get_peft_model

    from tandem.learner.layout import matmul_params, step_flops

    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    lengths = [64, 31]
    counter = FlopCounterMode(display=False)
    with counter:
        for s in lengths:
            model(torch.randint(0, 300, (1, s))).logits.float().sum().backward()
    counted = counter.get_total_flops()
    total, trained = matmul_params(model)
    assert 0 < trained < total / 5  # A and B, not the base
    ours = step_flops((total, trained), sum(lengths), sum(s * s for s in lengths),
                      attention_flops_per_pair(cfg.to_dict()), checkpointing)
    assert ours == pytest.approx(counted, rel=0.03)
    six_n = training_flops(sum(p.numel() for p in model.parameters()), sum(lengths), sum(s * s for s in lengths),
                           attention_flops_per_pair(cfg.to_dict()))
    if not checkpointing:
        assert six_n > 1.25 * counted  # the convention overstates what a LoRA step does
