"""vLLM alone as a benchmark candidate: the rollout ceiling, the engine sampling the workload's prompts with a random
adapter (or merged weights) and nothing else."""

from __future__ import annotations

import json
import time
from pathlib import Path

from machine import gpu_sampler
from workloads import TRL_VLLM_MEMORY, on_gpu, prompt_ids


def random_adapter(model_path: str, lora: dict, out: Path) -> Path:
    """A random peft adapter on the workload's model (what a trained one costs the engine)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    targets = lora.get("target_modules") or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"]
    pm = get_peft_model(m, LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"], target_modules=targets))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    pm.save_pretrained(out)
    return out


def run_vllm(paths, wl, args, lora: bool = True) -> dict:
    """The engine alone with the same settings Tandem's worker uses, generating the same batches; lora=False: the
    base weights without vLLM's LoRA layers, as an engine serving merged weights runs (TRL's colocated vLLM; the
    `vllm_merged` candidate: what the LoRA kernels cost a decode step)."""
    from tandem.core.compat import before_vllm_import
    before_vllm_import()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    gpu = on_gpu(args.workload)
    kw = dict(model=paths["model"], dtype=wl["model"]["dtype"], enforce_eager=not gpu, seed=0,
              max_model_len=64 + wl["max_tokens"], logprobs_mode="processed_logprobs",
              distributed_executor_backend="uni", enable_lora=lora,
              **(dict(max_lora_rank=max(8, wl["lora"]["r"]), max_loras=2) if lora else {}))
    kw.update({"gpu_memory_utilization": args.vllm_memory or TRL_VLLM_MEMORY} if gpu
              else {"kv_cache_memory_bytes": 256 << 20})
    llm = LLM(**kw)
    adapter = LoRARequest("bench", 1, str(random_adapter(paths["model"], wl["lora"], Path(args.dir) / "adapter"))) \
        if lora else None
    tok = AutoTokenizer.from_pretrained(paths["model"])
    rows = [json.loads(x) for x in Path(paths["data"]).read_text().splitlines()]
    prompts = [{"prompt_token_ids": prompt_ids(tok, r["prompt"])} for r in rows]
    sp = SamplingParams(n=wl["num_generations"], temperature=1.0, max_tokens=wl["max_tokens"], logprobs=0,
                        detokenize=False)
    P = wl["prompts"]
    times, toks, stop = [], [], None
    for i in range(wl["warmup"] + wl["steps"]):
        if i == wl["warmup"]:
            stop = gpu_sampler()
        t = time.time()
        outs = llm.generate(prompts[i * P:(i + 1) * P], sp, lora_request=adapter, use_tqdm=False)
        if i >= wl["warmup"]:
            times.append(time.time() - t)
            toks += [len(c.token_ids) for o in outs for c in o.outputs]
    g = stop() if stop else {}
    wall = sum(times)
    return {"s_per_step": wall / len(times), "gen_s_per_step": wall / len(times), "train_s_per_step": None,
            "completions_per_s": P * wl["num_generations"] * len(times) / wall, "gen_tokens_per_s": sum(toks) / wall,
            "publish_latency_s": None, "learner_mfu": None, **length_percentiles(toks, wl["max_tokens"]), **g}


def length_percentiles(lengths: list[int], cap: int) -> dict:
    """The measured completions' lengths: p50, p95 and the share at the cap (None each without any)."""
    import numpy as np

    if not lengths:
        return {"completion_length_p50": None, "completion_length_p95": None, "completion_at_cap_frac": None}
    return {"completion_length_p50": float(np.percentile(lengths, 50)),
            "completion_length_p95": float(np.percentile(lengths, 95)),
            "completion_at_cap_frac": float(np.mean(np.asarray(lengths) >= cap))}


