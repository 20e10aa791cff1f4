"""`vllm_mode: colocate` with a LoRA adapter served: the policy's frozen base reads the engine's tensors (a real vLLM
engine, the real policy; learner/shared_weights.py). On this CPU vLLM repacks its linear weights, so what can be shared
here is the rest (embedding, lm_head, norms, the packed q/k/v biases); on a GPU the linear weights too
(tests/integration/test_engine_memory_gpu.py)."""

import pytest
import torch

from tests.helpers import ROOT, make_job

pytestmark = pytest.mark.integration
REWARD = f"{ROOT}/examples/rewards.py:digits_reward"


@pytest.fixture
def in_process_engine(monkeypatch):
    """What a vLLM engine built in this process sets (tandem.core.compat.before_vllm_import), undone after the test:
    tests after it start subprocesses and actors that must not inherit it."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    dynamo = torch._dynamo.config
    disabled = dynamo.disable
    yield
    dynamo.disable = disabled


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_policy_reads_its_frozen_weights_from_the_engine_and_computes_the_same(tmp_path, tiny_model,
                                                                                   in_process_engine):
    from tandem.learner.model import load_policy
    from tandem.learner.shared_weights import checkpoint_name, frozen_parameters, share_engine_weights
    from tandem.rollout.worker import build_engine

    cfg = make_job(tmp_path, tiny_model, [REWARD], cluster={"vllm_mode": "colocate", "vllm_merge_adapter": False})
    engine = build_engine(cfg, seed=0)
    try:
        params, packed = engine.frozen_weights()
        assert packed.get("qkv_proj") == ["q_proj", "k_proj", "v_proj"]
        model = load_policy(cfg)
        ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
        before = logits(model, ids)
        frozen = frozen_parameters(model)
        own = {n: p.data.clone() for n, p in frozen.items()}
        # the engine's norm made different: that tensor stays the policy's own
        changed = dict(params, **{"model.norm.weight": params["model.norm.weight"] + 1})
        shared = share_engine_weights(model, changed, packed, torch.device("cpu"))

        def storage(t):
            return t.untyped_storage().data_ptr()

        engine_t = {checkpoint_name(k): v for k, v in params.items()}  # a LoRA layer's base under .base_layer.

        def reads_engine(name, vllm_name):
            return storage(frozen[name]) == storage(engine_t[vllm_name])

        layers = range(2)
        expect = {"model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
        expect |= {f"model.layers.{i}.{n}.weight": f"model.layers.{i}.{n}.weight" for i in layers
                   for n in ("input_layernorm", "post_attention_layernorm")}
        expect |= {f"model.layers.{i}.self_attn.{x}_proj.bias": f"model.layers.{i}.self_attn.qkv_proj.bias"
                   for i in layers for x in "qkv"}
        assert all(reads_engine(n, v) for n, v in expect.items()), [n for n, v in expect.items() if not reads_engine(n, v)]
        assert storage(frozen["model.norm.weight"]) != storage(engine_t["model.norm.weight"])  # not equal: not shared
        assert shared == sum(frozen[n].numel() * frozen[n].element_size() for n in expect)
        # the k bias is the packed bias's slice after q's rows
        q_rows = frozen["model.layers.0.self_attn.q_proj.bias"].numel()
        assert frozen["model.layers.0.self_attn.k_proj.bias"].data_ptr() == \
            engine_t["model.layers.0.self_attn.qkv_proj.bias"].data_ptr() + 4 * q_rows
        # the same values everywhere, and the same logits
        assert all(torch.equal(p.data, own[n]) for n, p in frozen.items())
        assert torch.equal(logits(model, ids), before)
    finally:
        engine.close()


def test_an_engine_whose_publish_rewrites_its_weights_gives_none(tmp_path, tiny_model, in_process_engine):
    from tandem.rollout.worker import build_engine

    cfg = make_job(tmp_path, tiny_model, [REWARD], cluster={"vllm_mode": "colocate"})  # merged on this CPU
    engine = build_engine(cfg, seed=0)
    try:
        assert engine.serves_one_version and engine.frozen_weights() == ({}, {})
    finally:
        engine.close()


def test_a_colocated_job_serving_an_adapter_trains_on_the_engines_weights(ray_session, tmp_path, tiny_model):
    """The colocated actor hands its engine's weights to the learner's setup; the learner's metrics say how much it
    reads from there, and at lag 0 the sampler's log-probs are still the learner's."""
    from tandem.services.orchestrator.controller import Controller
    from tests.helpers.learner import started
    from tests.integration.test_loop import SAME_WEIGHTS, loop_job

    cfg = loop_job(tmp_path, tiny_model, 0, batch={"max_steps": 2},
                   cluster={"vllm_mode": "colocate", "vllm_merge_adapter": False})
    ctl = started(Controller(cfg))
    try:
        steps = [s for _ in range(2) for s in ctl.step()["steps"]]
        embed = 512 * 64 * 4  # the tiny model's embedding alone, fp32: shared on any backend
        assert all(s["learner/engine_shared_gib"] * 2**30 >= embed for s in steps), steps
        assert all(s["tis/sampler_abs_diff_mean"] <= SAME_WEIGHTS for s in steps), steps
    finally:
        ctl.shutdown()
