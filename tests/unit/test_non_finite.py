"""learner/non_finite.py names the first input of a loss that is not finite where the loss reads it."""

import math

import pytest
import torch

from tandem.learner.grpo import LossInputs
from tandem.learner.non_finite import describe, non_finite_input


def inputs(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False  # row 1 is 3 tokens long
    return LossInputs(logp=lp.clone(), old_logp=lp.clone(), advantages=torch.randn(B, generator=g), mask=mask,
                      ref_logp=lp.clone(), sampler_logp=lp.clone() - 0.01)


@pytest.mark.parametrize("field,name", [("sampler_logp", "the sampler's log-probs"), ("old_logp", "old log-probs"),
                                        ("ref_logp", "reference log-probs"), ("logp", "log-probs")])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_each_per_token_input_is_named_with_its_row_and_token(field, name, value):
    x = inputs()
    getattr(x, field)[2, 4] = value
    getattr(x, field)[1, 4] = value  # masked out: not what the loss reads
    assert non_finite_input(x) == (name, 2, 4)


def test_the_first_input_in_computation_order_wins_and_masked_tokens_do_not_count():
    x = inputs()
    x.logp[0, 1] = math.nan
    x.sampler_logp[2, 0] = math.nan
    assert non_finite_input(x) == ("the sampler's log-probs", 2, 0)
    x.sampler_logp[2, 0] = -1.0
    x.old_logp[1, 4] = math.nan  # past row 1's completion
    assert non_finite_input(x) == ("log-probs", 0, 1)


def test_advantages_and_tis_weights():
    x = inputs()
    x.advantages[1] = math.nan
    assert non_finite_input(x) == ("advantages", 1, -1)
    x.advantages[1] = 0.5
    w = torch.ones_like(x.logp)
    w[0, 2] = math.inf
    assert non_finite_input(x, w) == ("TIS weights", 0, 2)
    assert non_finite_input(x, torch.ones_like(x.logp)) is None


def test_the_words_name_the_sequence_its_group_and_the_prompt():
    words = describe(("old log-probs", 1, 3), samples=[8, 9, 10], origins=[(7, 40), (7, 40), (8, 41)],
                     num_generations=4)
    assert words == ("old log-probs not finite at sequence 9 (completion 1 of group 7, the prompt at dataset "
                     "index 40), token 3")
    assert "advantages not finite at sequence 10" in describe(("advantages", 2, -1), [8, 9, 10],
                                                              [(7, 40), (7, 40), (8, 41)], 4)
    assert "overflowed" in describe(None, [0], [(0, 0)], 4)
