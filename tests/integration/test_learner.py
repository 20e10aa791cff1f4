"""Learner on real DeepSpeed (CPU, gloo): the update is exactly the spec's formula whatever
the accumulation, the number of ranks and the ZeRO stage."""

import pickle
import re
from pathlib import Path

import pytest
import torch

from tandem.learner.actor import Learner
from tandem.learner.safe_load import CheckpointRefused
from tests.helpers import ROOT, make_job
from tests.helpers.learner import make_groups, reference_step, sgd, started, with_tool_spans

pytestmark = pytest.mark.integration
REWARD = f"{ROOT}/examples/rewards.py:length_reward"
LR = 0.5


def job(tmp_path, model_path, *, per, ga, spg, loss_type="dapo", zero=0, nproc=1, mu=1, **extra):
    sections = dict(model={"fast_inference": False, "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
                    batch={"per_device_train_batch_size": per, "gradient_accumulation_steps": ga,
                           "steps_per_generation": spg, "num_generations": 4},
                    grpo={"loss_type": loss_type, "num_iterations": mu},
                    cluster={"zero_stage": zero, "num_processes": nproc},
                    optimizer={"max_grad_norm": 0.0, "learning_rate": LR, "lr_scheduler_type": "constant"})
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    return make_job(tmp_path, model_path, [REWARD], **sections)


def close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_accumulation_matches_whole_batch(tmp_path, tiny_model, loss_type, zero):
    groups = make_groups(2, 4, seed=1)  # 8 samples, unequal lengths
    c4 = job(tmp_path, tiny_model, per=2, ga=4, spg=4, loss_type=loss_type, zero=zero)
    l4 = started(Learner(c4, optimizer=sgd(LR)))
    before = l4.trainable_parameters()
    step = l4.train(groups)["steps"][0]
    got = {k.removeprefix("module."): v for k, v in l4.trainable_parameters().items()}
    want = reference_step(c4, groups, LR)
    close(got, want)
    # grad_norm is the norm of the gradient the step applied (SGD: delta / lr), at every ZeRO stage
    g = torch.cat([(before[k] - got[k.removeprefix("module.")]).flatten() for k in before]) / LR
    assert step["grad_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
    if loss_type == "bnpo":  # local normalisation really differs from dapo here
        other = reference_step(job(tmp_path, tiny_model, per=2, ga=4, spg=4, loss_type="dapo"), groups, LR)
        assert any(not torch.allclose(want[k], other[k], atol=1e-6) for k in want)
    # and GA=1 on the four micro-batches concatenated gives the same step (bnpo excepted: local)
    if loss_type != "bnpo":
        c1 = job(tmp_path, tiny_model, per=8, ga=1, spg=1, loss_type=loss_type, zero=zero)
        l1 = started(Learner(c1, optimizer=sgd(LR)))
        l1.train(groups)
        close(l1.trainable_parameters(), l4.trainable_parameters())


@pytest.mark.parametrize("loss_type,zero", [("dapo", 0), ("grpo", 2), ("dr_grpo", 0), ("bnpo", 3)])
def test_padding_free_micro_batches_match_the_padded_whole_batch(tmp_path, tiny_model, loss_type, zero):
    """model.padding_free: each micro-batch's sequences packed into one row (no attention mask: transformers keeps
    attention within each sequence from the restarting positions) == docs/grpo.md §4 on the padded whole batch."""
    groups = make_groups(2, 4, seed=1)  # 8 samples, unequal prompt and completion lengths
    ckpt = loss_type == "grpo"  # and recomputing the activations in backward changes nothing either
    cfg = job(tmp_path, tiny_model, per=2, ga=4, spg=4, loss_type=loss_type, zero=zero,
              model={"padding_free": True, "gradient_checkpointing": True if ckpt else "auto"})
    lr = started(Learner(cfg, optimizer=sgd(LR)))
    step = lr.train(groups)["steps"][0]
    assert step["learner/gradient_checkpointing"] == float(ckpt)  # auto: off on CPU
    assert step["learner/sm_carveout"] == 0.0  # off a GPU every core is the learner's
    close({k.removeprefix("module."): v for k, v in lr.trainable_parameters().items()}, reference_step(cfg, groups, LR))
    real = sum(len(g.prompt_ids) * 4 + len(g.tokens) for g in groups)  # prompts once per completion
    assert step["learner/tokens_per_s"] * step["train_s"] == pytest.approx(real, rel=1e-6)  # no padding counted
    assert step["learner/padding_frac"] == 0.0  # and none computed: padded, these micro-batches waste some
    phases = [step[f"learner/time/{p}_s"] for p in ("prepare", "forwards", "finish")]  # where train_s went
    assert min(phases) >= 0 and sum(phases) == pytest.approx(step["train_s"], abs=1e-6)  # a split, not a speed
    if loss_type != "dapo":
        return
    padded = started(Learner(job(tmp_path, tiny_model, per=2, ga=4, spg=4, loss_type=loss_type, zero=zero,
                                 model={"padding_free": False}), optimizer=sgd(LR))).train(groups)
    padded = padded["steps"][0]
    assert padded["learner/padding_frac"] > 0.1


@pytest.mark.parametrize("loss_type,zero,budget", [("dapo", 0, 1), ("grpo", 3, 1), ("bnpo", 2, 20),
                                                    ("dr_grpo", 0, 36), ("grpo", 0, 10_000)])
def test_a_token_budget_regroups_the_forwards_and_changes_no_weight(tmp_path, tiny_model, loss_type, zero, budget):
    """model.max_tokens_per_forward: the step's sequences in forwards of at most `budget` tokens (1: each alone,
    eight forwards for GA 4; 20, 36: five, three; 10,000: all in one), each weighted as its plan micro-batch (grpo: per sequence within
    it, bnpo: its token count) == docs/grpo.md §4 on the padded whole batch."""
    from tandem.learner.forwards import token_budget_bins

    groups = make_groups(2, 4, seed=5)
    cfg = job(tmp_path, tiny_model, per=2, ga=4, spg=4, loss_type=loss_type, zero=zero,
              model={"max_tokens_per_forward": budget})
    lr = started(Learner(cfg, optimizer=sgd(LR)))
    assert lr.token_budget == budget
    step = lr.train(groups)["steps"][0]
    close({k.removeprefix("module."): v for k, v in lr.trainable_parameters().items()}, reference_step(cfg, groups, LR))
    lengths = [len(g.prompt_ids) + len(g.completion(k)) for g in groups for k in range(4)]
    want = len(token_budget_bins([list(enumerate(lengths))], budget)[0])
    assert step["learner/forwards_per_step"] == want == {1: 8, 20: 5, 36: 3, 10_000: 1}[budget]  # GA is 4
    assert step["learner/max_tokens_per_forward"] == budget


@pytest.mark.parametrize("level,mu,padding_free", [("token", 2, False), ("sequence", 2, False), ("token", 1, False),
                                                   ("sequence", 1, False), ("token", 2, True)])
def test_all_loss_terms_match_whole_batch(tmp_path, tiny_model, level, mu, padding_free):
    """KL to the adapter-free reference, TIS, two-sided clipping, delta, temperature, two PPO epochs:
    the learner's micro-batched path (the fused loss for token level) == docs/grpo.md §4 on the whole batch.
    mu = 1: one optimizer step per cycle, so no separate old-log-prob forward (TIS from the training pass)."""
    groups = make_groups(2, 4, seed=11)
    cfg = job(tmp_path, tiny_model, per=4, ga=2, spg=2, mu=mu,
              grpo={"beta": 0.2, "epsilon_high": 0.28, "delta": 1.5, "importance_sampling_level": level,
                    "vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 1.2},
              generation={"temperature": 0.8}, model={"padding_free": padding_free})
    lr = started(Learner(cfg, optimizer=sgd(LR)))
    assert lr.needs_old() == (mu > 1)
    lora = [m for m in lr.model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    assert lora and all(hasattr(m, "_peft_forward") for m in lora)  # the fused LoRA op, against peft's in the reference
    lr.train(groups)
    close(lr.trainable_parameters(), reference_step(cfg, groups, LR, iterations=mu))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_tool_tokens_are_context_not_actions_on_the_fused_path(tmp_path, tiny_model, loss_type):
    """Multi-turn groups (a tool's span in each completion, loss_mask False): the learner's micro-batched, fused
    path equals docs/grpo.md §4 on the whole batch with those tokens masked (dapo counting the model's tokens only),
    and moving the tool tokens' sampler log-probs (TIS on) moves no parameter at all."""
    import copy

    import numpy as np

    groups = with_tool_spans(make_groups(2, 4, seed=13), seed=3)
    cfg = job(tmp_path, tiny_model, per=4, ga=2, spg=2, loss_type=loss_type,
              grpo={"beta": 0.1, "vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 1.2})
    a = started(Learner(cfg, optimizer=sgd(LR)))
    a.train(groups)
    close(a.trainable_parameters(), reference_step(cfg, groups, LR))
    moved = copy.deepcopy(groups)
    for g in moved:
        g.sampler_logprobs = np.where(g.loss_mask, g.sampler_logprobs, g.sampler_logprobs - 5.0).astype(np.float32)
    b = started(Learner(cfg, optimizer=sgd(LR)))
    b.train(moved)
    close(b.trainable_parameters(), a.trainable_parameters(), tol=0)


def test_zero3_with_reference_and_two_epochs_matches_whole_batch(tmp_path, tiny_model):
    """ZeRO-3 keeps a partition of the lm_head (gathered for the kernels) and counts micro-steps in
    engine.forward, which the learner bypasses: KL to the adapter-free reference, two PPO epochs."""
    groups = make_groups(2, 4, seed=1)
    cfg = job(tmp_path, tiny_model, per=4, ga=2, spg=2, mu=2, zero=3, grpo={"beta": 0.1})
    lr = started(Learner(cfg, optimizer=sgd(LR)))
    lr.train(groups)
    params = lr.trainable_parameters()
    close(params, reference_step(cfg, groups, LR, iterations=2))
    # what the rollout workers receive: the whole adapter, not this rank's partition
    sd = lr.gathered_state()
    assert sd
    close({k: v.float() for k, v in sd.items()}, {k: params[k.replace(".weight", ".default.weight")] for k in sd})


def test_two_ppo_epochs_match_hand_rolled_loop(tmp_path, tiny_model):
    groups = make_groups(2, 4, seed=2)
    cfg = job(tmp_path, tiny_model, per=8, ga=1, spg=1, mu=2)
    lr = started(Learner(cfg, optimizer=sgd(LR)))
    assert lr.needs_old()
    out = lr.train(groups)
    assert len(out["steps"]) == 2
    close(lr.trainable_parameters(), reference_step(cfg, groups, LR, iterations=2))


def test_positive_advantage_raises_logprob(tmp_path, tiny_model):
    from tandem.learner.batch import Samples, collate, to_device
    from tandem.learner.logprobs import completion_logprobs

    groups = make_groups(1, 4, seed=3)
    groups[0].rewards[:] = 0.0
    groups[0].rewards[2] = 1.0  # completion 2 is the good one
    groups[0].eos[:] = True
    cfg = job(tmp_path, tiny_model, per=4, ga=1, spg=1, optimizer={"learning_rate": 1e-2})
    lr = started(Learner(cfg))
    s = Samples.from_groups(groups)
    mb = to_device(collate(s, range(4), torch.zeros(4), pad_id=0, mask_truncated=False), lr.device)

    def seq_logp():
        with torch.no_grad():
            lp, _ = completion_logprobs(lr.model, mb, 1.0)
        return (lp * mb["mask"]).sum(-1)

    before = seq_logp()
    for _ in range(3):
        lr.train(groups)
    after = seq_logp()
    assert after[2] > before[2] + 1e-3
    assert all(after[i] < before[i] for i in (0, 1, 3))


def test_checkpoint_resume_is_bit_identical(tmp_path, tiny_model):
    cfg = job(tmp_path, tiny_model, per=4, ga=1, spg=2, optimizer={"learning_rate": 1e-2, "max_grad_norm": 1.0})
    b1, b2 = make_groups(2, 4, seed=4), make_groups(2, 4, seed=5)
    a = started(Learner(cfg))
    a.train(b1)
    ck = a.save_checkpoint(str(tmp_path / "ck" / "step-1"))
    assert not (tmp_path / "ck" / "step-1.tmp").exists()
    a.train(b2)
    b = started(Learner(cfg))
    meta = b.load_checkpoint(ck)
    assert meta["version"] == 1 and b.version == 1
    b.train(b2)
    pa, pb = a.trainable_parameters(), b.trainable_parameters()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert a.version == b.version == 2


def test_reference_is_base_model(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    from tandem.learner.batch import Samples, collate, to_device
    from tandem.learner.logprobs import completion_logprobs

    groups = make_groups(1, 4, seed=6)
    cfg = job(tmp_path, tiny_model, per=4, ga=1, spg=1, grpo={"beta": 0.1},
              optimizer={"learning_rate": 5e-2})
    lr = started(Learner(cfg))
    lr.train(groups)
    lr.train(groups)  # adapter now non-zero
    s = Samples.from_groups(groups)
    mb = to_device(collate(s, range(4), torch.zeros(4), pad_id=0, mask_truncated=False), lr.device)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to(lr.device)
    with torch.no_grad():
        want = completion_logprobs(base, mb, 1.0)[0]
        ref = lr._logp(mb, reference=True)
        pol = lr._logp(mb)[0]
    m = mb["mask"]
    assert torch.allclose(ref[m], want[m], atol=1e-5)
    assert not torch.allclose(pol[m], want[m], atol=1e-4)


def test_non_finite_loss_stops_before_the_weights_move(tmp_path, tiny_model):
    """A NaN sampler log-prob (TIS on) makes micro-step 2 of 4 non-finite: train raises, naming the
    forward, the input, the sequence, the token and the prompt, and no weight has moved (the optimizer step comes only at the fourth)."""
    groups = make_groups(2, 4, seed=13)
    groups[1].sampler_logprobs[0] = float("nan")  # the first token of sample 4: micro-batch 2
    cfg = job(tmp_path, tiny_model, per=2, ga=4, spg=4, grpo={"vllm_importance_sampling_correction": True},
              model={"max_tokens_per_forward": None})  # the plan's four micro-batches, one forward each
    lr = started(Learner(cfg, optimizer=sgd(LR)))
    before = lr.trainable_parameters()
    with pytest.raises(FloatingPointError, match=r"non-finite loss nan at forward 2 of 4: the sampler's log-probs "
                       r"not finite at sequence 4 \(completion 0 of group 1, the prompt at dataset index 1\), token 0"):
        lr.train(groups)
    after = lr.trainable_parameters()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("field", ["prompt_ids", "tokens"])
def test_token_id_outside_the_vocabulary_is_named(tmp_path, tiny_model, field):
    groups = make_groups(2, 4, seed=14)
    getattr(groups[1], field)[1] = 512  # the tiny model's vocabulary is 0..511
    lr = started(Learner(job(tmp_path, tiny_model, per=4, ga=1, spg=2)))
    before = lr.trainable_parameters()
    with pytest.raises(ValueError, match=f"group 1 {field} holds token id 512; the model's vocabulary is 0..511"):
        lr.train(groups)
    assert all(torch.equal(before[k], v) for k, v in lr.trainable_parameters().items())


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_learner_follows_the_float32_reference(tmp_path, tiny_model, zero):
    """The learner trains in bf16 (on CUDA through the Triton fused loss; ZeRO-3: the gathered head):
    its SGD update (lora_B from zero, so the update is the weight) is the float32 whole-batch
    reference's to bf16 accuracy."""
    from tandem.learner.model import load_policy

    groups = make_groups(2, 4, seed=12)
    kw = dict(per=2, ga=4, spg=4, generation={"temperature": 0.9}, grpo={"epsilon_high": 0.28})
    lr = started(Learner(job(tmp_path, tiny_model, zero=zero, model={"dtype": "bfloat16"}, **kw),
                         optimizer=sgd(LR)))
    before = lr.trainable_parameters()
    lr.train(groups)
    after = lr.trainable_parameters()
    cfg32 = job(tmp_path, tiny_model, **kw)
    torch.manual_seed(cfg32.seed)
    init = {n: p.detach().clone() for n, p in load_policy(cfg32).named_parameters() if p.requires_grad}
    want = reference_step(cfg32, groups, LR)
    key = lambda k: k.removeprefix("module.")
    got = torch.cat([(after[k].float() - before[k].float()).flatten() for k in sorted(after)])
    ref = torch.cat([(want[key(k)] - init[key(k)]).flatten() for k in sorted(after)])
    assert ref.norm() > 0 and ((got - ref).norm() / ref.norm()).item() <= 5e-2


def test_a_bf16_zero0_step_checks_its_gradients_in_one_readback(tmp_path, tiny_model):
    """bf16 at ZeRO-0 steps through DeepSpeed's FP16_Optimizer: its inf/NaN check is learner/overflow.py's, which
    answers as DeepSpeed's own per-tensor check on the engine's gradients, finite and with a NaN planted."""
    from deepspeed.runtime.utils import CheckOverflow

    lr = started(Learner(job(tmp_path, tiny_model, per=4, ga=1, spg=2, model={"dtype": "bfloat16"})))
    checker = lr.engine.optimizer.overflow_checker
    assert checker.has_overflow.__func__.__module__ == "tandem.learner.overflow"
    params = [p for p in lr.engine.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    assert checker.has_overflow(params) is False
    assert CheckOverflow.has_overflow(checker, params) is False
    params[len(params) // 2].grad.view(-1)[1] = float("nan")
    assert checker.has_overflow(params) is True
    assert CheckOverflow.has_overflow(checker, params) is True


def test_rank_0_holds_the_groups_port_from_its_rendezvous_on(ray_session, tmp_path, tiny_model):
    """rendezvous() returns rank 0's node address and a port its store already listens on, before any setup: no
    window in which another process can take the port (a probe socket bound and closed leaves one)."""
    import socket

    import ray

    rank0 = Learner(job(tmp_path, tiny_model, per=2, ga=1, spg=2, nproc=2), rank=0, world=2)
    host, port = rank0.rendezvous()
    assert host == ray.util.get_node_ip_address()
    with socket.socket() as s:
        with pytest.raises(OSError):
            s.bind(("", port))
    with socket.create_connection((host, port), timeout=5):
        pass


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])  # dr_grpo: grpo's cross-rank sequence count, a constant per token
def test_two_ranks_match_one(ray_session, tmp_path, tiny_model, loss_type):
    """Two Ray learner actors on half the batch each == one rank on the whole batch (ZeRO 2); grpo's two ranks
    padding-free (model.padding_free) under a token budget that gives them unequal forwards, the one rank padded."""
    from tandem.learner.forwards import _first_fit_decreasing, token_budget_bins
    from tandem.learner.group import LearnerGroup

    groups = make_groups(2, 4, seed=7)
    n = [len(g.prompt_ids) + len(g.completion(k)) for g in groups for k in range(4)]
    # grpo: a token budget under which rank 0 (rows 0-1, 4-5) and rank 1 (2-3, 6-7) need different numbers of
    # forwards, so one splits its own to run as many backward passes as the other
    ranks = [[(i, n[i]) for i in (0, 1, 4, 5)], [(i, n[i]) for i in (2, 3, 6, 7)]]
    budget = next(b for b in range(1, 100) if len({len(_first_fit_decreasing(r, b)) for r in ranks}) == 2)
    assert len({len(b) for b in token_budget_bins(ranks, budget)}) == 1
    c2 = job(tmp_path, tiny_model, per=2, ga=2, spg=2, loss_type=loss_type, zero=2, nproc=2,
             model={"padding_free": loss_type == "grpo", "max_tokens_per_forward": budget})
    g2 = LearnerGroup(c2, total_steps=10, optimizer=sgd(LR))
    out = g2.train(groups)
    assert out["version"] == 1 and len(out["steps"]) == 1
    p2 = g2.trainable_parameters()
    g2.shutdown()
    c1 = job(tmp_path, tiny_model, per=8, ga=1, spg=1, loss_type=loss_type)
    l1 = started(Learner(c1, optimizer=sgd(LR)))
    l1.train(groups)
    close(p2, l1.trainable_parameters())


def test_learner_metrics_match_math_functions(tmp_path, tiny_model):
    """The learner's reported metrics are loss_metrics/rollout stats of the same batch."""
    from tandem.learner.batch import Samples, collate
    from tandem.learner.grpo import compute_advantages, loss_metrics
    from tandem.learner.logprobs import completion_logprobs
    from tandem.learner.model import load_policy

    groups = make_groups(2, 4, seed=8)
    cfg = job(tmp_path, tiny_model, per=8, ga=1, spg=1, grpo={"vllm_importance_sampling_correction": True,
              "vllm_importance_sampling_cap": 1.5}, generation={"temperature": 0.8})
    assert cfg.tis
    got = started(Learner(cfg, optimizer=sgd(LR))).train(groups)["steps"][0]
    torch.manual_seed(cfg.seed)
    model = load_policy(cfg)
    s = Samples.from_groups(groups)
    adv = compute_advantages(torch.from_numpy(s.rewards), 4)
    mb = collate(s, range(8), adv, pad_id=0, mask_truncated=False)
    with torch.no_grad():
        logp, ent = completion_logprobs(model, mb, 0.8, with_entropy=True)
    want = loss_metrics(logp, logp, mb["advantages"], mb["mask"], sampler_logp=mb["sampler_logp"], tis_cap=1.5,
                        entropy=ent)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    r = s.rewards[:, 0]
    assert got["reward"] == pytest.approx(float(r.mean()), rel=1e-6)
    assert got["completion_length"] == pytest.approx(sum(len(c) for c in s.completions) / 8)
    assert got["frac_truncated"] == pytest.approx(1 - s.eos.mean())


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_planted_pickle_in_any_checkpoint_file_is_refused_and_runs_nothing(tmp_path, tiny_model, zero):
    """Each file of a real checkpoint in turn replaced by a pickle whose loading would create a file:
    loading the checkpoint fails naming that file, and the file is never created."""
    import shutil

    cfg = job(tmp_path, tiny_model, per=4, ga=1, spg=1, zero=zero)
    a = started(Learner(cfg))
    a.train(make_groups(1, 4, seed=1))
    ck = Path(a.save_checkpoint(str(tmp_path / "ck" / "good")))
    files = [f.relative_to(ck) for f in sorted(ck.rglob("*")) if f.is_file() and f.suffix in (".pt", ".safetensors", ".json")
             and f.parent.name != "adapter"]  # the user's artifact (safetensors + config): not read on resume
    assert {f.suffix for f in files} == {".pt", ".safetensors", ".json"} and len(files) >= 3 + (zero > 0), files
    b = started(Learner(cfg))
    for rel in files:
        bad = tmp_path / "ck" / f"bad-{rel.name}"
        shutil.copytree(ck, bad)
        marker = tmp_path / f"ran-{rel.name}"
        if rel.suffix == ".json":
            (bad / rel).write_bytes(pickle.dumps(Payload(marker)))
        else:
            torch.save({"state": Payload(marker)}, bad / rel)
        with pytest.raises(CheckpointRefused, match=re.escape(str(bad / rel))):
            b.load_checkpoint(str(bad))
        assert not marker.exists(), f"loading {rel} ran the planted code"
    b.load_checkpoint(str(ck))  # the untouched checkpoint still loads
    assert b.version == 1


FULL_DISK = r'''
import os, resource, signal, sys
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from pathlib import Path
from tests.helpers import make_job
from tests.helpers.learner import make_groups, started
from tandem.learner.actor import Learner
from tandem.learner.safe_load import CheckpointWriteError

tmp = Path(TMP)
cfg = make_job(tmp, MODEL, [f"{ROOT}/examples/rewards.py:length_reward"], model={"fast_inference": False},
               cluster={"zero_stage": 2}, batch={"per_device_train_batch_size": 4, "num_generations": 4})
a = started(Learner(cfg))
a.train(make_groups(1, 4))
good = a.save_checkpoint(str(tmp / "ck" / "cycle-000001"))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
try:
    a.save_checkpoint(str(tmp / "ck" / "cycle-000002"))
    print("NO ERROR")
except CheckpointWriteError as e:
    print("REFUSED", e)
'''


def test_a_checkpoint_that_cannot_be_written_names_its_path_and_leaves_nothing_half_written(tmp_path, tiny_model):
    """Files may not grow past 20 kB (RLIMIT_FSIZE: writes fail as on a full disk): the save fails with
    one message naming the checkpoint's path; no partial directory is left, the previous one stays."""
    import subprocess
    import sys

    script = f"ROOT = {str(ROOT)!r}\nTMP = {str(tmp_path)!r}\nMODEL = {tiny_model!r}\n" + FULL_DISK
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert out.startswith(f"REFUSED checkpoint: writing {tmp_path / 'ck' / 'cycle-000002.tmp'} failed"), out
    assert "nothing was half-written" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["cycle-000001"]
    assert (tmp_path / "ck" / "cycle-000001" / "tandem.json").is_file()


def test_a_learner_starts_after_torchs_group_was_destroyed_behind_deepspeeds_back(tmp_path, tiny_model):
    """In one process (a notebook): a learner, then torch.distributed.destroy_process_group() (how transformers' and
    TRL's trainers end), then another learner: DeepSpeed's cached groups are forgotten with the old default group, so
    the second engine starts ("Group ... is not registered" otherwise). In a process of its own: the state is global."""
    import subprocess
    import sys

    code = f"""
import torch.distributed as dist
from tandem.learner.actor import Learner
from tests.helpers import ROOT, make_job
from tests.helpers.learner import started
from pathlib import Path
cfg = make_job(Path({str(tmp_path)!r}), {tiny_model!r}, [f"{{ROOT}}/examples/rewards.py:length_reward"],
               model={{"fast_inference": False}})
started(Learner(cfg))
dist.destroy_process_group()
started(Learner(cfg))
print("second learner started")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "second learner started" in p.stdout, p.stderr[-3000:]
