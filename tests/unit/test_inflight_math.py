"""The in-flight rules of docs/grpo.md §6 against independent computations: each token's version from the loads a
request rode across, the token bound, and `old` and the TIS weight of a sequence sampled under several versions."""

import numpy as np
import torch

from tandem.core.protocol import RolloutGroup, pack_completions
from tandem.learner.batch import Samples, collate, token_bound
from tandem.learner.grpo import tis_weight
from tandem.learner.logprobs import completion_logprobs
from tandem.learner.model import load_policy
from tandem.rollout.engine_loop import token_versions
from tests.helpers import ROOT, make_job
from tests.helpers.publish import TOL, adapter_like


def test_token_versions_follow_each_sequences_own_boundaries():
    # started on 3; at the load of 4 sequence 0 had 2 tokens, sequence 1 had finished (absent); at 5, sequence 0 had 6
    b = [(4, {0: 2, 2: 1}), (5, {0: 6})]
    assert token_versions(3, b, 0, 8).tolist() == [3, 3, 4, 4, 4, 4, 5, 5]
    assert token_versions(3, b, 1, 5).tolist() == [3] * 5
    assert token_versions(3, b, 2, 3).tolist() == [3, 4, 4]  # finished before the load of 5
    assert token_versions(3, [], 0, 2).dtype == np.int32


def group(versions: list[list[int]], version: int = 0) -> RolloutGroup:
    comps = [np.arange(3, 3 + len(v), dtype=np.int32) for v in versions]
    toks, offs = pack_completions(comps)
    tv, _ = pack_completions([np.asarray(v, dtype=np.int32) for v in versions])
    G = len(versions)
    return RolloutGroup(0, 0, np.arange(3, 8, dtype=np.int32), toks.astype(np.int32), offs,
                        np.zeros(len(toks), np.float32), np.ones(G, bool), np.zeros((G, 1), np.float32), version,
                        token_versions=tv.astype(np.int32))


def test_the_bound_masks_the_tokens_too_old_for_the_weights_not_the_group():
    g = group([[0, 0, 1, 1, 2], [2, 2], [0, 0, 0]])
    assert g.newest_version == 2 and g.completion_versions(1).tolist() == [2, 2]
    s = Samples.from_groups([g], version=2, max_lag=1)
    assert [m.tolist() for m in s.loss_masks] == [[False, False, True, True, True], [True, True], [False] * 3]
    assert s.stale_tokens == 5 and s.loss_mask_counts(range(3), mask_truncated=False) == 5  # dapo's N
    # a tool's token (loss_mask False) is not counted as stale: it was never the model's to train
    g.loss_mask = np.array([False, True, True, True, True, True, True, True, True, True])
    assert Samples.from_groups([g], version=2, max_lag=1).stale_tokens == 4
    # no bound given (groups finishing whole: the controller bounds them): nothing masked
    assert all(m.all() for m in Samples.from_groups([group([[0, 1]])]).loss_masks)
    assert token_bound(np.array([0, 1, 2, 3]), 3, 2).tolist() == [False, True, True, True]


def reference_logprobs(model, prompt: np.ndarray, completion: np.ndarray) -> torch.Tensor:
    """log softmax of a plain forward over prompt + completion, gathered at the completion: no Tandem code."""
    ids = torch.as_tensor(np.concatenate([prompt, completion]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)


def test_old_and_the_tis_weight_of_a_sequence_sampled_under_three_versions(tiny_model, tmp_path):
    """A completion whose tokens came from versions 1, 2 and 3 (two loads mid-sequence), trained by the weights of
    version 3: `old` is the learner's log-prob of every token under version 3 over the whole sequence (Tandem's
    completion_logprobs against a plain forward), `samp` each token's own version's (plain forwards), and the TIS
    weight min(exp(old - samp), cap) per token, from the version that sampled it."""
    from peft import set_peft_model_state_dict

    cfg = make_job(tmp_path, tiny_model, [f"{ROOT}/examples/rewards.py:length_reward"])
    model = load_policy(cfg).eval()
    adapters = {v: adapter_like(model, v) for v in (1, 2, 3)}
    rng = np.random.default_rng(0)
    prompt, comp = rng.integers(3, 500, 7).astype(np.int32), rng.integers(3, 500, 12).astype(np.int32)
    versions = np.array([1] * 4 + [2] * 5 + [3] * 3, dtype=np.int32)
    per_version = {}
    for v, a in adapters.items():
        set_peft_model_state_dict(model, a)
        per_version[v] = reference_logprobs(model, prompt, comp)
    samp = torch.stack([per_version[int(v)][t] for t, v in enumerate(versions)])  # what the engine recorded
    g = RolloutGroup(0, 0, prompt, comp, np.array([0, len(comp)]), samp.float().numpy(), np.ones(1, bool),
                     np.zeros((1, 1), np.float32), 1, token_versions=versions)
    s = Samples.from_groups([g], version=3, max_lag=2)  # every token within the bound
    assert s.loss_masks[0].all()
    mb = collate(s, [0], torch.zeros(1), pad_id=0, mask_truncated=False)
    set_peft_model_state_dict(model, adapters[3])  # the weights that train on the batch
    with torch.no_grad():
        old = completion_logprobs(model, mb, 1.0)[0][0]
    assert (old.double() - per_version[3]).abs().max() <= TOL
    w = tis_weight(old[None], mb["sampler_logp"], mb["mask"], cap=2.0)[0].double()
    want = torch.clamp(torch.exp(per_version[3] - samp), max=2.0)
    assert (w - want).abs().max() <= 1e-4 * want.max()
    assert (w[versions == 3] - 1).abs().max() <= 1e-4  # a token sampled by the training weights: weight 1
    assert (w[versions != 3] - 1).abs().max() > 1e-3  # the others corrected from their own version
