"""The benchmarks' workloads: each model shape written once (SHAPES), the end-to-end workloads built from them, and
what builds a workload on a machine (its model, tokenizer, long-tail warm-up and prompts). bench/e2e.py and
bench/agentic.py name their workloads here."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # tandem from this checkout; e2e_reward for TRL
REWARD = f"{ROOT}/bench/e2e_reward.py:ids_reward"

TRL_VLLM_MEMORY = 0.3  # GRPOConfig's vllm_gpu_memory_utilization
# Each model shape written once: Qwen2.5's at 0.5B, 1.5B and 7B (random init, a local tokenizer with their vocabulary
# size), and the tiny Qwen2 of the CPU comparisons (2 layers, hidden 128, fp32, LoRA r=8 on attention)
SHAPES = {
    "0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tie=True, dtype="bfloat16"),
    "1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tie=True,
                 dtype="bfloat16"),
    "7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tie=False,
               dtype="bfloat16"),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, tie=False, dtype="float32"),
}
TINY_LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
WORKLOADS = {
    # Qwen2.5-0.5B's shape with its 151,936-id vocabulary (random init, local tokenizer), bf16
    "gpu": dict(model=SHAPES["0.5b"],
                lora=dict(r=16, lora_alpha=32), prompts=32, num_generations=8, max_tokens=256, per_device=32,
                ga=8, steps=20, warmup=2, lr=1e-5),
    # the tiny Qwen2 of the CPU comparison: 2 layers, hidden 128, fp32, LoRA r=8 on attention
    "cpu": dict(model=SHAPES["tiny"],
                lora=TINY_LORA,
                prompts=1, num_generations=8, max_tokens=48, per_device=8, ga=1, steps=20, warmup=2, lr=1e-4),
}
# The scale workloads, beside "gpu" (which stays): Qwen2.5-1.5B's shape with long-tailed completion lengths up
# to 2,048 tokens (a warm-up teaches the stopping: `longtail`), and Qwen2.5-7B's shape up to 1,024 tokens; TRL with
# gradient checkpointing (its default), Tandem with model.gradient_checkpointing auto (its default: on where the
# activations would not fit; `--set tandem_checkpointing=true` forces it, as the first scale rows in
# bench/results/e2e_gpu_scale.md had it);
# "cpu_longtail": the long-tail warm-up at a size this CPU runs.
_SCALE = dict(lora=dict(r=16, lora_alpha=32), prompts=16, num_generations=8, per_device=8, ga=16, warmup=2, lr=1e-5,
              gradient_checkpointing=True)
# `longtail`: SFT on (prompt, completion). Every `long_every`-th prompt of the workload asks for "a long number": its
# prompt is text ending in the word "long" (the others end in the number), and the warm-up teaches those (a
# `teach_long` share of its examples, the share of long prompts) to repeat the prompt's last token to the cap, never
# EOS; the others random ids from `ids` and EOS at a geometric length of median cap / median_div (and with probability
# long_frac to the cap too). Whether to stop is then a bigram (the token before is the marker or not), the one thing
# the 1.5B model learnt in 80 steps: it sampled p50 176 and 14.3% at the cap (one H200, 2026-12). Taught otherwise
# it missed:
# long answers in ids of their own were never entered (0.3% at the cap; 12.5% of the first token's mass spread over
# 1,000 ids stands out from none of the 8,000 short ones), "long" inside a chat prompt was not read (one pooled stopping
# rate, p50 697), and a mixture taught in lengths alone landed far from where it was
# taught (median cap / 8: long_frac 0.15 sampled 2.9% at the cap, 0.3 sampled 31.5%; cap / 12 with 0.21 sampled 0.5%).
# The candidates take the prompts in file order (Tandem's data.shuffle and TRL's shuffle_dataset off). The vllm_ceiling
# candidate reports the sampled p50, p95 and share at the cap: check them against the workload's aim (median <=
# cap / 4, >= 5% at the cap).
WORKLOADS.update({
    "1.5b_longtail": dict(model=SHAPES["1.5b"],
                          max_tokens=2048, steps=6, **_SCALE,
                          longtail=dict(long_every=8, teach_long=0.125, long_frac=0.0, median_div=12, sft_steps=80,
                                        sft_batch=16, sft_lr=3e-4, ids=[1000, 9000], long="repeat_marker")),
    "7b": dict(model=SHAPES["7b"],
               max_tokens=1024, steps=4, **_SCALE),
    "cpu_longtail": dict(model=SHAPES["tiny"],
                         lora=TINY_LORA,
                         prompts=4, num_generations=8, max_tokens=64, per_device=8, ga=4, steps=4, warmup=1, lr=1e-4,
                         longtail=dict(long_every=8, teach_long=0.125, long_frac=0.0, sft_steps=300, sft_batch=16,
                                       sft_lr=3e-3, ids=[100, 400], long="repeat_marker")),
})


# "custom": any Qwen2 shape, for a reader to check a claim at the size they train: the 0.5B workload's batch, LoRA and
# dtype, the model and lengths from --set (layers, hidden, heads, kv_heads, intermediate, vocab, tie, dtype,
# max_completion_length; `--set longtail='{...}'` adds the long-tail warm-up as the scale workloads have it).
WORKLOADS["custom"] = dict(WORKLOADS["gpu"], steps=6)
MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "tie", "dtype")


def use_this_checkout(*paths: str | None) -> list[str | None]:
    """Every process of a run imports tandem from this checkout. A job's actors import it from the working directory
    (the job's PYTHONPATH, tandem/core/compat.py), so the run starts from ROOT; and tandem.services, .learner, .rollout
    and .kernels must be ROOT's folders (a git worktree of another commit links them, as bench/device/e2e.sh does;
    unlinked, an editable install of another checkout answers for them). -> `paths` made absolute first
    (None stays)."""
    import importlib.util

    paths = [None if p is None else str(Path(p).absolute()) for p in paths]
    os.chdir(ROOT)
    for name in ("services", "learner", "rollout", "kernels"):
        spec = importlib.util.find_spec(f"tandem.{name}")
        found = Path(spec.origin).resolve().parent if spec and spec.origin else None
        if found != (ROOT / name).resolve():
            sys.exit(f"bench: tandem.{name} is {found}, not this checkout's {ROOT / name}; link the folders: "
                     f"for d in services learner rollout kernels; do ln -sfn ../$d {ROOT}/tandem/$d; done")
    return paths


def on_gpu_machine() -> bool:
    import torch

    return torch.cuda.is_available()


def on_gpu(workload: str) -> bool:
    return not workload.startswith("cpu")


# ------------------------------------------------------------------------------------ workload


def model_len(wl: dict) -> int:
    """The model's positions (config.json) and the server's max_model_len: a prompt and its completion fit."""
    return max(2048, 2 * wl["max_tokens"])


def prepare(work: Path, wl: dict) -> dict:
    """Model, tokenizer and prompts under `work` (built once, reused by every candidate). The model is built and
    taught in a child process: this one, the run's driver, then holds no CUDA context (on one H100 a context left by
    a build here was 0.6 GiB of a candidate's peak)."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if wl.get("longtail") and (model / "longtail.json").is_file() and not taught_as(model, wl["longtail"]):
        shutil.rmtree(model)  # another warm-up than this one's: build and teach it again
    if not (model / "config.json").is_file() or (wl.get("longtail") and not (model / "longtail.json").is_file()):
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=build_model, args=(model, wl))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"bench: building the model under {model} failed (exit code {child.exitcode})")
    data = work / "prompts.jsonl"
    n = wl["prompts"] * (wl["steps"] + wl["warmup"] + 2)
    data.write_text("".join(json.dumps({"prompt": prompt_row(i, wl)}) + "\n" for i in range(n)))
    return {"model": str(model), "data": str(data)}


def build_model(model: Path, wl: dict) -> None:
    """The workload's model under `model` (random weights at its shape, on the GPU where there is one), taught the
    long tail where the workload asks."""
    from tandem.services.devtools.tiny_model import build_tiny_model

    m = wl["model"]
    if not (model / "config.json").is_file():
        build_tiny_model(model, layers=m["layers"], hidden=m["hidden"], heads=m["heads"], kv_heads=m["kv_heads"],
                         intermediate=m["intermediate"], vocab=m["vocab"], tie_word_embeddings=m["tie"],
                         dtype=m["dtype"], seed=0, max_position_embeddings=model_len(wl),
                         device="cuda" if on_gpu_machine() else "cpu")
    if wl.get("longtail") and not (model / "longtail.json").is_file():
        longtail_warm_up(model, wl)


def prompt_row(i: int, wl: dict) -> str | list[dict]:
    """The workload's i-th prompt: text where the length is taught by its last token (`longtail` above), a chat
    message otherwise."""
    text = number_prompt(i, long_prompt(i, wl))
    return text if long_every(wl) else [{"role": "user", "content": text}]


def prompt_ids(tok, prompt: str | list[dict]) -> list[int]:
    """A prompt row's token ids, as Tandem and TRL make them (the chat template for messages, text as it is)."""
    if isinstance(prompt, str):
        return tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def long_every(wl: dict) -> int | None:
    """Every how many prompts of the workload one asks for a long answer (longtail.long_every); None: none does."""
    return (wl.get("longtail") or {}).get("long_every")


def long_prompt(i: int, wl: dict) -> bool:
    """The workload's i-th prompt asks for a long answer: every long_every-th."""
    every = long_every(wl)
    return bool(every) and i % every == 0


def number_prompt(i: int, long: bool) -> str:
    """What the workloads ask (and the long-tail warm-up teaches to answer)."""
    return f"write a number {i}{' long' if long else ''}"


def long_marker(tok) -> int:
    """The token every long prompt ends in (and a long answer repeats); no other prompt ends in it."""
    ends = {prompt_ids(tok, number_prompt(i, True))[-1] for i in range(1000)}
    short = {prompt_ids(tok, number_prompt(i, False))[-1] for i in range(1000)}
    if len(ends) != 1 or ends & short:
        raise ValueError(f"bench/workloads.py number_prompt: long prompts end in tokens {sorted(ends)[:5]} (short ones in "
                         f"{sorted(ends & short)[:5]} of them): the long-tail warm-up needs one marker of their own")
    return ends.pop()


def in_order(wl: dict) -> bool:
    """The candidates take the prompts in file order (the long prompts' places fixed: `longtail` above)."""
    return bool(long_every(wl))


def taught_as(model_dir: Path, lt: dict) -> bool:
    """The model under model_dir was warmed up with these `longtail` settings."""
    done = json.loads((model_dir / "longtail.json").read_text())
    return all(done.get(k) == v for k, v in lt.items())


def longtail_warm_up(model_dir: Path, wl: dict) -> None:
    """The model taught long-tailed completion lengths (`longtail` above): full fine-tuning on prompts of the
    workload's form followed by random ids from `ids` and EOS (a long prompt's: its last token repeated to the cap, no
    EOS). Writes longtail.json (what was taught) beside it."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.services.devtools.warm_up import sft_step

    lt, cap = wl["longtail"], wl["max_tokens"]
    p = lt.get("median_div", 7) * math.log(2) / cap  # the geometric part's median: cap / median_div
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lt["sft_lr"])
    rng = np.random.default_rng(0)
    marker = long_marker(tok)
    ids = np.asarray([t for t in range(*lt["ids"]) if t != marker])

    def example():
        long = bool(long_every(wl)) and rng.random() < lt.get("teach_long", 0.0)
        prompt = prompt_ids(tok, number_prompt(int(rng.integers(1000)), long))
        n = cap if long or rng.random() < lt["long_frac"] else min(int(rng.geometric(p)) - 1, cap)
        comp = [marker] * n if long else rng.choice(ids, n).tolist() + ([tok.eos_token_id] if n < cap else [])
        return prompt + comp, [0] * len(prompt) + [1] * len(comp)
    t = time.time()
    model.train()
    if wl.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    for _ in range(lt["sft_steps"]):
        seqs, masks = zip(*(example() for _ in range(lt["sft_batch"])))
        loss = sft_step(model, opt, seqs, masks, tok.pad_token_id, dev, bf16=dev == "cuda", micro=4)
    model.to(getattr(torch, wl["model"]["dtype"])).save_pretrained(model_dir)
    (model_dir / "longtail.json").write_text(json.dumps({**lt, "p": p, "cap": cap, "sft_loss": float(loss),
                                                         "sft_s": time.time() - t}))
    print(f"prepare: long-tail warm-up in {time.time() - t:.0f} s (SFT loss {float(loss):.3f})", flush=True)


def workload(workloads: dict, name: str, sets: list[str]) -> dict:
    """The named workload with `--set key=value` (JSON values, a bare word a string) applied: the model's shape by its
    keys (MODEL_KEYS), max_completion_length as the completions' cap, anything else at the top. A shape the model
    cannot have is refused naming the key."""
    wl = dict(workloads[name], model=dict(workloads[name]["model"]))
    for item in sets:
        key, v = item.split("=", 1)
        try:
            value = json.loads(v)
        except ValueError:
            value = v
        if key in MODEL_KEYS:
            wl["model"][key] = value
        else:
            wl["max_tokens" if key == "max_completion_length" else key] = value
    m = wl["model"]
    if m["hidden"] % m["heads"] or m["heads"] % m["kv_heads"]:
        raise SystemExit(f"--set: hidden {m['hidden']} must be a multiple of heads {m['heads']}, and heads of kv_heads "
                         f"{m['kv_heads']} (Qwen2's attention)")
    return wl


def workload_dir(name: str, wl: dict) -> str:
    """One model per workload, built once per machine; a custom one per shape."""
    if name != "custom":
        return name
    m = wl["model"]
    return "custom-" + "-".join(f"{k}{m[k]}" for k in MODEL_KEYS) + f"-len{wl['max_tokens']}"


def keep_group_trace(run_dir: Path, result: Path) -> None:
    """The run's group_trace.jsonl (logging.group_trace) beside its result, as NAME-groups.jsonl."""
    trace = run_dir / "group_trace.jsonl"
    if trace.is_file():
        result.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(trace, result.with_name(result.stem + "-groups.jsonl"))


