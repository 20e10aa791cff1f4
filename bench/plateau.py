"""The engine's throughput plateau: decode tokens/s against sequences in flight (how full an engine must be kept).

  python3 bench/plateau.py --shape 1.5b [--tokens 512] [--seqs 16,32,64,128,256,512] [--memory 0.3] [--no-lora]
      [--json OUT.json] [--dir WORK]

One vLLM engine as a Tandem rollout worker runs it on a GPU (CUDA graphs, the job's default memory share 0.3, a
rank-16 LoRA adapter on every projection served as a LoRARequest, the sampled token's log-prob returned), random
weights at the named shape, prompts of 64 random token ids, every completion exactly --tokens long (ignore_eos, so
the batch stays full: the plateau, not a length distribution). For each number of sequences one generate call;
prints the table (tokens/s, × the 128-sequence point) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

SHAPES = {  # Qwen2.5's shapes (config.json of each), vocabulary included
    "0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tie=True),
    "1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tie=True),
    "7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tie=False),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(work: Path, shape: str) -> tuple[Path, Path]:
    """The model (random init, bf16) and a random rank-16 adapter on every projection (B != 0: it computes)."""
    import torch

    from tandem.core.adapter import write_peft_adapter
    from tandem.core.config import LoraConfig
    from tandem.services.devtools.tiny_model import build_tiny_model

    m = SHAPES[shape]
    model, adapter = work / f"model-{shape}", work / f"adapter-{shape}"
    if not (model / "config.json").is_file():
        build_tiny_model(model, layers=m["layers"], hidden=m["hidden"], heads=m["heads"], kv_heads=m["kv_heads"],
                         intermediate=m["intermediate"], vocab=m["vocab"], tie_word_embeddings=m["tie"],
                         dtype="bfloat16", seed=0, max_position_embeddings=4096)
    hd = m["hidden"] // m["heads"]
    dims = {"q_proj": (m["hidden"], m["heads"] * hd), "k_proj": (m["hidden"], m["kv_heads"] * hd),
            "v_proj": (m["hidden"], m["kv_heads"] * hd), "o_proj": (m["heads"] * hd, m["hidden"]),
            "gate_proj": (m["hidden"], m["intermediate"]), "up_proj": (m["hidden"], m["intermediate"]),
            "down_proj": (m["intermediate"], m["hidden"])}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(m["layers"]):
        for t in TARGETS:
            block = "self_attn" if t in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{i}.{block}.{t}"
            n_in, n_out = dims[t]
            tensors[f"{name}.lora_A.weight"] = (torch.randn(16, n_in, generator=g) * 0.01).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(n_out, 16, generator=g) * 0.01).bfloat16()
    write_peft_adapter(adapter, tensors, LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)), str(model))
    return model, adapter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.5b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seqs", default="16,32,64,128,256,512")
    ap.add_argument("--memory", type=float, default=0.3)
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--dir", default="/tmp/tandem-plateau")
    ap.add_argument("--json")
    a = ap.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    t0 = time.time()
    model, adapter = build(Path(a.dir), a.shape)
    print(f"model and adapter built in {time.time() - t0:.0f} s", flush=True)

    import os

    from tandem.core.compat import before_vllm_import

    before_vllm_import()  # the engine core in this process, as in a rollout worker
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not among the GPU wheels here
    import numpy as np
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    t0 = time.time()
    llm = vllm.LLM(str(model), dtype="bfloat16", gpu_memory_utilization=a.memory, max_num_seqs=max(seqs),
                   max_model_len=64 + a.tokens + 8, enable_lora=not a.no_lora, max_lora_rank=16, max_loras=3,
                   seed=0, enable_prefix_caching=False)
    start_s = time.time() - t0
    print(f"engine started in {start_s:.0f} s", flush=True)
    lora = None if a.no_lora else LoRARequest("bench", 1, str(adapter))
    rng = np.random.default_rng(0)
    vocab = SHAPES[a.shape]["vocab"]

    def run(n: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, vocab - 100, 64).tolist()) for _ in range(n)]
        sp = vllm.SamplingParams(max_tokens=a.tokens, min_tokens=a.tokens, ignore_eos=True, temperature=1.0, logprobs=0)
        t = time.time()
        outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        dt = time.time() - t
        assert all(len(o.outputs[0].token_ids) == a.tokens for o in outs)
        return dt

    run(8)  # warm-up: the adapter loads, the graphs run once
    rows = []
    for n in seqs:
        dt = run(n)
        rows.append({"seqs": n, "s": dt, "tokens_per_s": n * a.tokens / dt})
        print(f"{n:5d} sequences: {n * a.tokens / dt:9.0f} tokens/s ({dt:.2f} s)", flush=True)
    ref = next((r["tokens_per_s"] for r in rows if r["seqs"] == 128), rows[-1]["tokens_per_s"])
    print("\n| sequences in flight | tokens/s | × 128 sequences | s per batch |\n| --: | --: | --: | --: |")
    for r in rows:
        print(f"| {r['seqs']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ref:.2f} | {r['s']:.2f} |")
    out = {"shape": a.shape, "tokens": a.tokens, "memory": a.memory, "lora": not a.no_lora, "engine_start_s": start_s,
           "vllm": vllm.__version__, "rows": rows}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
