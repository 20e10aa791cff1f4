"""cluster.vllm_gpu_memory_utilization: auto. The engine's weights and KV arithmetic against what transformers' own
models hold (their parameters, their KV cache after a forward), and the sizes a job asks for written out by hand."""

import pytest
import torch

from tandem.core.engine_memory import (
    ENGINE_OVERHEAD,
    GIB,
    engine_bytes,
    engine_kv_bytes,
    engine_max_num_seqs,
    kv_bytes_per_token,
    oversample_prompts,
    prompts_ahead,
    prompts_in_flight,
    sequences_in_engine,
    weight_bytes,
)

QWEN2 = dict(model_type="qwen2", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
             num_hidden_layers=3, vocab_size=300)


def _model(kind, tie, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = {k: v for k, v in QWEN2.items() if k != "model_type"} | kw
    conf = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**shape, tie_word_embeddings=tie)
    return (Qwen2ForCausalLM if kind == "qwen2" else LlamaForCausalLM)(conf)


@pytest.mark.parametrize("kind,tie,extra", [("qwen2", True, {}), ("qwen2", False, {}), ("llama", False, {}),
                                            ("llama", True, {"attention_bias": True}),
                                            ("llama", False, {"head_dim": 32})])
def test_weight_bytes_are_the_models_parameters(kind, tie, extra):
    model = _model(kind, tie, **extra)
    n = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert weight_bytes(model.config.to_dict(), 2) == 2 * n


def test_kv_bytes_per_token_are_what_the_models_cache_holds():
    model = _model("llama", False, head_dim=32).eval()
    T = 7
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 300, (1, T)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model.config.to_dict(), 4) * T == held


def job(gpus=1.0, share="auto", ga=16, **cluster):
    """Over-sampling is the setting where a group finishes under its own version (cluster.inflight_updates: false)."""
    from tandem.core.config import JobConfig

    if "rollout_oversample_prompts" in cluster:
        cluster.setdefault("inflight_updates", False)

    return JobConfig.from_dict({
        "model": {"path": "m", "dtype": "bfloat16"}, "data": {"path": "d.jsonl"}, "rewards": ["r:f"],
        "generation": {"max_prompt_length": 64, "max_completion_length": 2048},
        "batch": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": ga, "num_generations": 8},
        "cluster": {"vllm_gpu_memory_utilization": share, "rollout_resources": {"num_gpus": gpus}, **cluster}})


QWEN_1_5B = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
             "num_hidden_layers": 28, "vocab_size": 151936, "model_type": "qwen2", "tie_word_embeddings": True}


def test_auto_holds_every_sequence_the_controller_keeps_in_the_engine_at_full_length():
    # 16 prompts a cycle (8 x 16 / 8); on a GPU 256 // 8 = 32 prompts in flight at most; the controller hands out
    # max_staleness + 1 cycles: 16 prompts at k=0, 32 at k=1, still 32 at k=3
    assert [sequences_in_engine(job(max_staleness=k)) for k in (0, 1, 3)] == [128, 256, 256]
    # 256 sequences of 64 + 2,048 tokens, 28 layers x 2 x 2 heads x 128 x 2 B
    k1 = job(max_staleness=1)
    kv = engine_kv_bytes(k1, QWEN_1_5B)
    assert kv == 256 * 2112 * (28 * 2 * 2 * 128 * 2)  # ~14.4 GiB
    assert engine_kv_bytes(job(), QWEN_1_5B) == kv // 2
    weights = 2 * (151936 * 1536 + 28 * (1536 * 1536 + 2 * 1536 * 256 + 1536 * 1536 + 1536 + 2 * 256
                                         + 3 * 1536 * 8960 + 2 * 1536) + 1536)  # ~1.54B parameters
    assert engine_bytes(k1, QWEN_1_5B, 140 * GIB) == weights + kv + ENGINE_OVERHEAD
    assert 22 * GIB < weights + kv + ENGINE_OVERHEAD < 23 * GIB  # against TRL's 0.3 of an H200: 42 GiB
    # fewer prompts in flight, or vLLM capped lower: fewer sequences
    assert sequences_in_engine(job(rollout_prompts_in_flight=4)) == 32
    assert sequences_in_engine(job(vllm_max_num_seqs=100)) == 96  # 12 whole groups
    capped = job(vllm_max_num_seqs=100, rollout_prompts_in_flight=20)  # 128 asked, vLLM runs 100, queues the rest
    assert engine_kv_bytes(capped, QWEN_1_5B) == 100 * 2112 * 28 * 2 * 2 * 128 * 2
    # a share set by hand; auto of a model whose shape is unknown: TRL's 0.3
    assert engine_bytes(job(share=0.5), QWEN_1_5B, 140 * GIB) == 70 * GIB
    assert engine_bytes(job(), {"hidden_size": 1536}, 140 * GIB) == int(0.3 * 140 * GIB)


def test_a_job_with_tools_hands_out_what_the_staleness_bound_allows_and_sizes_the_engine_by_its_plateau():
    def tools(**cluster):
        cfg = job(**cluster)
        return cfg.model_copy(update={"tools": ["t:add"]})

    # 16 prompts a cycle: k + 1 cycles out, where the job without tools stops at the plateau's 256 // 8 = 32
    assert [prompts_in_flight(tools(max_staleness=k)) for k in (0, 1, 4)] == [16, 32, 80]
    assert [prompts_in_flight(job(max_staleness=k)) for k in (0, 1, 4)] == [32, 32, 32]
    # between turns an episode holds no sequence in the engine: the KV cache still for the plateau's 256 at most
    assert [sequences_in_engine(tools(max_staleness=k)) for k in (0, 1, 4)] == [128, 256, 256]
    assert engine_kv_bytes(tools(max_staleness=4), QWEN_1_5B) == engine_kv_bytes(job(max_staleness=1), QWEN_1_5B)
    # set by hand: as set, for the hand-outs and (under the plateau) the cache
    assert prompts_in_flight(tools(max_staleness=4, rollout_prompts_in_flight=4)) == 4
    assert sequences_in_engine(tools(max_staleness=4, rollout_prompts_in_flight=4)) == 32


def test_over_sampled_prompts_go_out_beside_the_plateau_and_wait_in_the_engine_past_it():
    over, plain = job(max_staleness=1, rollout_oversample_prompts=8), job(max_staleness=1)
    assert prompts_in_flight(over) == 32 + 8  # the plateau's 256 // 8, and the 8 beyond the bound
    # the KV cache stays the plateau's: vLLM runs at most its 256 sequences and queues the rest (no preemption)
    assert sequences_in_engine(over) == sequences_in_engine(plain) == 256
    assert engine_kv_bytes(over, QWEN_1_5B) == engine_kv_bytes(plain, QWEN_1_5B)
    assert (engine_max_num_seqs(over), engine_max_num_seqs(plain)) == (256, None)  # None: vLLM's own default
    # a batch of one prompt: k + 1 batches are 2 prompts, far under the plateau, and the 16 over-sampled run beside
    # them (18 groups, 144 sequences, a cache for them), not queued
    small, small_plain = job(max_staleness=1, rollout_oversample_prompts=16, ga=1), job(max_staleness=1, ga=1)
    assert (sequences_in_engine(small_plain), sequences_in_engine(small), engine_max_num_seqs(small)) == (16, 144, 144)
    # set by hand, the user's numbers hold: prompts in flight as set (the cache for them), max_num_seqs as set
    by_hand = job(max_staleness=1, rollout_oversample_prompts=8, rollout_prompts_in_flight=40)
    assert sequences_in_engine(by_hand) == 40 * 8 and engine_max_num_seqs(by_hand) is None
    assert engine_max_num_seqs(job(max_staleness=1, rollout_oversample_prompts=8, vllm_max_num_seqs=128)) == 128


def test_auto_over_sampling_keeps_the_plateaus_prompts_out_while_a_batch_trains():
    # 16 prompts a batch (8 x 16 / 8), the plateau's 32 groups: at k = 1 a training leaves one batch out, so 16 more
    assert [oversample_prompts(job(max_staleness=k, rollout_oversample_prompts="auto")) for k in (0, 1, 2, 4)] == \
        [0, 32 - 16, 0, 0]
    # 64 a batch at 8 x 64: one batch already fills the plateau's 32, nothing beyond
    big = job(max_staleness=1, rollout_oversample_prompts="auto", ga=64)
    assert oversample_prompts(big) == 0 and engine_max_num_seqs(big) is None
    # a plateau of 512 sequences (64 groups) at k = 2: 64 - 2 x 16
    assert oversample_prompts(job(max_staleness=2, rollout_oversample_prompts="auto", vllm_max_num_seqs=512)) == 32
    # in flight (the default) no group is stopped: none to stand in for
    assert oversample_prompts(job(max_staleness=1, rollout_oversample_prompts="auto", inflight_updates=True)) == 0
    # a CPU engine has no plateau: none
    assert oversample_prompts(job(gpus=0, max_staleness=1, rollout_oversample_prompts="auto")) == 0
    # with tools the bound already lets out every episode the engine holds
    tools = job(max_staleness=1, rollout_oversample_prompts="auto").model_copy(update={"tools": ["t:add"]})
    assert oversample_prompts(tools) == 0
    # what auto sets is what a number sets: the same hand-outs, engine cache and vLLM queue
    auto, sixteen = job(max_staleness=1, rollout_oversample_prompts="auto"), job(max_staleness=1,
                                                                                 rollout_oversample_prompts=16)
    for f in (prompts_in_flight, prompts_ahead, sequences_in_engine, engine_max_num_seqs):
        assert f(auto) == f(sixteen), f.__name__
    assert (prompts_ahead(auto), sequences_in_engine(auto), engine_max_num_seqs(auto)) == (48, 256, 256)


def test_a_learner_beside_an_auto_engine_counts_what_the_engine_will_take():
    from tandem.learner.memory import (
        ACTIVATION_SHARE,
        SHARED_GPU_SHARE,
        activation_bytes_per_token,
        forward_layout,
        learner_budget,
    )

    total, held = 140 * GIB, 4 * GIB
    per_token = activation_bytes_per_token(QWEN_1_5B, 2)
    shared = job(0.4, learner_resources={"num_gpus": 0.4})
    room = learner_budget(total, held, engine_bytes(shared, QWEN_1_5B, total))
    assert room == total - (engine_bytes(shared, QWEN_1_5B, total)) - held - 2 * GIB
    # an engine holding 1,728 sequences (~105 GiB) leaves less: 3/4 of the rest binds
    less = job(0.4, learner_resources={"num_gpus": 0.4}, rollout_prompts_in_flight=216,
               max_staleness=13)  # 1,728 sequences: ~105 GiB
    assert forward_layout(less, QWEN_1_5B, True, (total, held)) == \
        (int(0.75 * learner_budget(total, held, engine_bytes(less, QWEN_1_5B, total)) // per_token), False)
    # k=0's engine is small: activations and engine together take SHARED_GPU_SHARE (~12k tokens, a fifth of the device)
    k0 = engine_bytes(shared, QWEN_1_5B, total)
    assert forward_layout(shared, QWEN_1_5B, True, (total, held)) == \
        (int((SHARED_GPU_SHARE * total - k0) // per_token), False)
    assert 11_000 < (SHARED_GPU_SHARE * total - k0) // per_token < 13_000
    # k=1's, twice the KV cache: the two together still within SHARED_GPU_SHARE, under TRL's server alone (0.3 of the
    # device, its trainer beside it), and the forwards still long enough to run without checkpointing
    k1 = job(0.4, learner_resources={"num_gpus": 0.4}, max_staleness=1)
    assert engine_bytes(k1, QWEN_1_5B, total) > k0 + 6 * GIB
    tokens, checkpointed = forward_layout(k1, QWEN_1_5B, True, (total, held))
    assert not checkpointed and 8192 <= tokens and \
        tokens * per_token + engine_bytes(k1, QWEN_1_5B, total) <= SHARED_GPU_SHARE * total < 0.3 * total + 3 * GIB
    # an engine of more than that (four batches of 128 sequences out): activations keep ACTIVATION_SHARE of the device
    big = job(0.4, learner_resources={"num_gpus": 0.4}, max_staleness=3, rollout_prompts_in_flight=64)
    assert engine_bytes(big, QWEN_1_5B, total) > (SHARED_GPU_SHARE - ACTIVATION_SHARE) * total
    assert forward_layout(big, QWEN_1_5B, True, (total, held)) == (int(ACTIVATION_SHARE * total // per_token), False)
