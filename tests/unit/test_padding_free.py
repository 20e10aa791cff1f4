"""model.padding_free on plain tensors and a real tiny model: the packed micro-batch holds the same tokens, each
completion token is predicted from its own sequence's position, and the log-probs equal the padded batch's."""

import torch

from tandem.learner.batch import Samples, collate
from tests.helpers.learner import make_groups


def batches(n=2, G=4, seed=3):
    s = Samples.from_groups(make_groups(n, G, seed=seed, vocab=500))
    adv = torch.linspace(-1, 1, len(s))
    rows = range(len(s))
    return s, (collate(s, rows, adv, pad_id=0, mask_truncated=True, padding_free=p) for p in (False, True))


def test_a_packed_micro_batch_holds_every_sequence_once_and_points_at_each_completion_token():
    s, (padded, packed) = batches()
    seqs = [torch.as_tensor(list(s.prompts[i]) + list(s.completions[i])) for i in range(len(s))]
    assert packed["input_ids"].shape == (1, sum(map(len, seqs))) and torch.equal(packed["input_ids"][0], torch.cat(seqs))
    assert torch.equal(packed["position_ids"][0], torch.cat([torch.arange(len(x)) for x in seqs]))
    for k in ("completion_ids", "mask", "sampler_logp", "advantages"):
        assert torch.equal(packed[k], padded[k]), k
    ids, g = packed["input_ids"][0], packed["gather"]
    for b in range(len(s)):
        c = len(s.completions[b])
        assert torch.equal(ids[g[b, :c] + 1], padded["completion_ids"][b, :c])  # position t predicts token t + 1
    assert "attention_mask" not in packed


def test_packed_log_probs_equal_the_padded_ones_and_need_the_restarting_positions(tiny_model):
    from transformers import AutoModelForCausalLM

    from tandem.learner.logprobs import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    s, (padded, packed) = batches()
    with torch.no_grad():
        want, got = (completion_logprobs(model, mb, 1.0)[0] for mb in (padded, packed))
        lengths = torch.tensor([len(c) for c in s.completions])
        m = torch.arange(padded["completion_ids"].shape[1])[None] < lengths[:, None]  # every real completion token
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)
        # one sequence after another, positions running on: attention crosses sequences and the numbers move
        run_on = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1])[None]}
        assert not torch.allclose(completion_logprobs(model, run_on, 1.0)[0][m], want[m], atol=1e-3)
