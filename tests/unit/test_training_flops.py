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
