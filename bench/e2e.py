"""End-to-end GRPO, side by side: Tandem (`tandem run`'s own controller, embedded Ray), the engine alone
(the rollout ceiling) and TRL's GRPOTrainer as its users run it, on one workload. The entry points
`e2e_gpu.py` / `e2e_cpu.py` fix the workload; this module builds it and runs one candidate per process:

  python3 bench/e2e.py run CANDIDATE --workload gpu|cpu --dir WORK --json OUT.json [--rollout-gpus ...]
  python3 bench/e2e.py table OUT_DIR --workload gpu|cpu   # the table from the candidates' JSON files

Every candidate samples the same prompts with the same model, LoRA, reward, batch and sampling. A
measured step is an optimizer step after the warm-up ones. GPU busy fraction and peak memory are
sampled from nvidia-smi every 0.2 s (the whole GPU: every process on it); on CPU the memory is the
PSS of the process tree (psutil), the driver, Ray's processes and its workers included.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

T0 = time.time()  # launch: "launch to first step" counts from here
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # tandem from this checkout; e2e_reward for TRL
REWARD = f"{ROOT}/bench/e2e_reward.py:ids_reward"

WORKLOADS = {
    # Qwen2.5-0.5B's shape with its 151,936-id vocabulary (random init, local tokenizer), bf16
    "gpu": dict(model=dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tie=True,
                           dtype="bfloat16"),
                lora=dict(r=16, lora_alpha=32), prompts=32, num_generations=8, max_tokens=256, per_device=32,
                ga=8, steps=20, warmup=2, lr=1e-5),
    # the tiny Qwen2 of the CPU comparison: 2 layers, hidden 128, fp32, LoRA r=8 on attention
    "cpu": dict(model=dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, tie=False,
                           dtype="float32"),
                lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
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
    "1.5b_longtail": dict(model=dict(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
                                     tie=True, dtype="bfloat16"),
                          max_tokens=2048, steps=6, **_SCALE,
                          longtail=dict(long_every=8, teach_long=0.125, long_frac=0.0, median_div=12, sft_steps=80,
                                        sft_batch=16, sft_lr=3e-4, ids=[1000, 9000], long="repeat_marker")),
    "7b": dict(model=dict(layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tie=False,
                          dtype="bfloat16"),
               max_tokens=1024, steps=4, **_SCALE),
    "cpu_longtail": dict(model=dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, tie=False,
                                    dtype="float32"),
                         lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
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


# Tandem's candidates: max_staleness, cluster.vllm_mode, model.fast_inference
# tandem_k2_colocate: two batches out while one trains (the engine's batch shared by twice the sequences)
# tandem_k4: the bound TRL's AsyncGRPOTrainer runs at by default (TRL_ASYNC_STALENESS), a row beside trl_async
TANDEM = {"tandem_k0": (0, "server", True), "tandem_k1": (1, "server", True), "tandem_k4": (4, "server", True),
          "tandem_k0_colocate": (0, "colocate", True), "tandem_k1_colocate": (1, "colocate", True),
          "tandem_k2_colocate": (2, "colocate", True),
          "tandem_k0_generate": (0, "server", False), "tandem_k1_generate": (1, "server", False)}
# the same job on two Ray nodes of this machine (run_tandem_nodes): max_staleness
TANDEM_NODES = {"tandem_k1_nodes": 1}
TRL_VLLM_MEMORY = 0.3  # GRPOConfig's vllm_gpu_memory_utilization
# Tandem's run goes one step past the measured ones, its time reported (end_step_s), not averaged in: the run's end is
# one step a run takes once, which over a few measured steps would weigh as one in four. Before the run-end hand-out
# (services/orchestrator/pipeline.py) the last batch at max_staleness >= 1 waited for the slowest completions of every
# prompt still out (the 1.5B long tail's last steps ran 13.6-21.3 s against 4-8 s before); kept so that results from
# before and after that change compare. TRL's trainers stop without waiting for what they have not trained.
END_STEPS = 1
KEYS = ("s_per_step", "gen_s_per_step", "train_s_per_step", "completions_per_s", "gen_tokens_per_s",
        "gpu_busy_frac", "peak_gpu_gib", "publish_latency_s")


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
        raise ValueError(f"bench/e2e.py number_prompt: long prompts end in tokens {sorted(ends)[:5]} (short ones in "
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


def gpu_sampler():
    """(stop() -> {busy_frac, peak_gib, peak GiB by process}) from nvidia-smi every 0.2 s (the processes' every
    second), or None without one."""
    try:
        p = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                              "-lms", "200"], stdout=subprocess.PIPE, text=True)
        apps = subprocess.Popen(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits",
                                 "-lms", "1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except FileNotFoundError:
        return None
    util, mem, by_process = [], [], {}

    def read():
        for line in p.stdout:
            try:
                u, m = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            util.append(u)
            mem.append(m)

    def read_apps():
        for line in apps.stdout:
            if (seen := gpu_process(line)) and (role := process_role(seen[0])):  # "": not yet exec'd
                name = f"{role} [{seen[0]}]"
                by_process[name] = max(by_process.get(name, 0.0), seen[1])
    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=read_apps, daemon=True).start()

    def stop():
        p.terminate()
        apps.terminate()
        # utilization.gpu: the share of each sample period with a kernel running; its mean is the busy fraction
        return {"gpu_busy_frac": (sum(util) / len(util) / 100) if util else None,
                "peak_gpu_gib": (max(mem) / 1024) if mem else None,
                # where the peak goes: each process's own peak (their sum can exceed the whole's: not all at once)
                "peak_gpu_gib_by_process": {k: v / 1024 for k, v in sorted(by_process.items())} or None}
    return stop


def gpu_process(line: str) -> tuple[int, float] | None:
    """(pid, MiB) from one line of `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`;
    None for anything else (a header, a blank, "[N/A]" where the driver does not say)."""
    try:
        pid, mib = (x.strip() for x in line.split(","))
        return int(pid), float(mib)
    except ValueError:
        return None


def process_role(pid: int) -> str:
    """A GPU process by what it runs: Ray's title for an actor (`ray::RolloutWorker.generate` -> `RolloutWorker`),
    else the program (vLLM's engine core by its own title) and its script's name; "?" where /proc does not show it
    (another pid namespace)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return role_of(" ".join(a.decode(errors="replace") for a in argv if a))


def role_of(cmdline: str) -> str:
    """The role in a process's command line (process_role); "" for an empty one."""
    first = cmdline.split(" ")[0] if cmdline else ""
    if first.startswith("ray::"):
        return first[5:].split(".")[0] or "ray"
    words = cmdline.split()
    script = next((Path(w).name for w in words[1:] if w.endswith(".py")), None)
    return f"{Path(first).name} {script}" if script else Path(first).name


def host_state(sample_s: float = 1.0, busy_pct: float = 10.0) -> dict:
    """The machine a candidate starts on: its CPU, its load, and every process outside this one's tree that kept a
    core at least `busy_pct` percent busy over `sample_s` seconds, by role. A peer whose trainer is bound by the host's
    work around its kernels runs at the machine's pace: TRL's step at the 1.5B long tail moved from 9.9 to 6.1 s
    between two H100 leases while Tandem's stayed (bench/results/e2e_gpu_scale.md), so each run says what it ran on."""
    import psutil

    me = psutil.Process()
    mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
    others = [p for p in psutil.process_iter() if p.pid not in mine]
    for p in others:
        try:
            p.cpu_percent(None)  # the first call starts the process's count
        except psutil.Error:
            pass
    time.sleep(sample_s)
    busy = {}
    for p in others:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= busy_pct:
            busy[f"{process_role(p.pid)} [{p.pid}]"] = round(pct)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    return {"cpu_model": model, "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
            "busy_processes": busy}


def tree_pss_gb() -> float:
    import psutil

    total = 0
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    for pr in procs:
        try:
            total += pr.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pass
    return total / 1e9


class PeakPSS:
    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_gb())
            time.sleep(0.5)

    def stop(self) -> float:
        self._stop.set()
        return self.peak


def cpu_busy_sampler():
    import psutil

    psutil.cpu_percent(percpu=True)
    return lambda: psutil.cpu_percent(percpu=True)


# ---------------------------------------------------------------------------------- candidates


def tandem_config(paths, wl, k, args, mode="server", vllm=True):
    """The workload as a Tandem job (max_staleness k, cluster.vllm_mode mode; vllm False: fast_inference
    false, transformers generate samples)."""
    from tandem.core.config import JobConfig

    gpu = on_gpu(args.workload)
    res = lambda g: {"num_cpus": 1, "num_gpus": g}
    return JobConfig.from_dict({
        "model": {"path": paths["model"], "dtype": wl["model"]["dtype"], "lora": wl["lora"],
                  "fast_inference": vllm, "gradient_checkpointing": wl.get("tandem_checkpointing", "auto"),
                  **{k: wl[k] for k in ("padding_free", "max_tokens_per_forward", "use_liger_kernel")
                     if k in wl}},  # else Tandem's defaults
        "data": {"path": paths["data"], "shuffle": not in_order(wl)}, "rewards": [REWARD],
        "generation": {"temperature": 1.0, "max_prompt_length": 64, "max_completion_length": wl["max_tokens"]},
        "batch": {"per_device_train_batch_size": wl["per_device"], "gradient_accumulation_steps": wl["ga"],
                  "num_generations": wl["num_generations"], "max_steps": wl["steps"] + wl["warmup"] + END_STEPS},
        "grpo": {"loss_type": "dapo", "beta": 0.0},
        "optimizer": {"learning_rate": wl["lr"], "lr_scheduler_type": "constant"},
        "cluster": {"num_rollout_workers": 1, "max_staleness": k, "vllm_mode": mode,
                    "rollout_resources": res(args.rollout_gpus if gpu else 0),
                    "learner_resources": res(args.learner_gpus if gpu else 0),
                    "vllm_gpu_memory_utilization": args.vllm_memory or "auto",
                    # each where the workload sets it, else Tandem's default
                    **{k: wl[k] for k in ("learner_sm_carveout", "vllm_merge_adapter", "rollout_prompts_in_flight",
                                          "rollout_oversample_prompts", "vllm_max_num_seqs", "inflight_updates",
                                          "inflight_kv", "max_token_lag") if k in wl}},
        # group_trace: what became of each group (bench/results keep it beside the run's JSON)
        "logging": {"output_dir": str(Path(args.dir) / f"run-k{k}"), "progress": False, "group_trace": True},
    })


def run_tandem(paths, wl, k, args, mode="server", vllm=True) -> dict:
    return measure_tandem(tandem_config(paths, wl, k, args, mode, vllm), wl, on_gpu(args.workload))


def run_tandem_nodes(paths, wl, k, args) -> dict:
    """The tandem_k{k} job with its learner on one Ray node (the head, a `learner` resource) and its rollout worker
    on another (a `rollout` resource), two `ray start` of this machine each offering its GPUs: the adapter goes
    from node to node through Ray's object transfer, as between two machines, not through one node's store."""
    import secrets
    import tempfile

    from tandem.services.devtools.local_nodes import join_nodes, start_head, stop

    gpus = 1 if on_gpu(args.workload) else None
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))  # the driver joins with it
    env = dict(os.environ)
    cpus = max((os.cpu_count() or 2) // 2, 1)
    head, gcs = start_head(env, tempfile.mkdtemp(prefix="ray"), cpus, gpus, {"learner": 1})
    node = None
    try:
        [node] = join_nodes(gcs, env, {"rollout": 1}, cpus, 1, num_gpus=gpus)
        cfg = tandem_config(paths, wl, k, args)
        c = cfg.cluster
        cfg = cfg.model_copy(update={"cluster": c.model_copy(update={
            "rollout_resources": c.rollout_resources.model_copy(update={"resources": {"rollout": 1}}),
            "learner_resources": c.learner_resources.model_copy(update={"resources": {"learner": 1}})})})
        return measure_tandem(cfg, wl, gpus is not None, address=gcs)
    finally:
        import ray

        ray.shutdown()
        stop([node, head] if node else [head])


def actor_nodes(ray, ctl) -> dict:
    """The Ray node ids of the job's learner ranks and rollout workers, asked of the actors through the controller."""
    def ask(self):
        import ray

        def node(a):
            return ray.get(a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
        return {"learner": [node(a) for a in self.learner.actors], "rollout": [node(w) for w in self.workers]}
    return ray.get(ctl.__ray_call__.remote(ask))


CYCLE_KEYS = ("step", "generate_wait_s", "train_s", "publish_s", "cycle_s", "rollout_busy_s", "rollout/batch_sampling_s",
              "rollout/group_sampling_s", "rollout/group_buffered_s", "rollout/sampled_ahead_frac",
              "learner/time/forwards_s",
              "prompts_in_flight", "queue_depth", "count/batches_trained_ahead", "count/burst_waits", "count/stale_dropped",
              "count/stale_stopped", "count/stale_failed", "count/stale_dropped_tokens", "rollout/stale_waste_frac",
              "rollout/engine_steps_per_s", "rollout/sequences_per_step",
              # what the batch trained and how far behind it was: which of the two k >= 1 regimes a cycle is in
              "completion_length", "completion_length_max", "staleness_hist")


def rollout_snapshot(ray, ctl) -> dict:
    """The controller's snapshot of its serving rollout workers' stats (services/orchestrator/run_log.py
    rollout_rates): {"t", "workers": {worker: stats}}."""
    return ray.get(ctl.__ray_call__.remote(lambda self: self._rollout_stats()))


def engine_start_s(ray, ctl) -> list:
    """Each serving rollout worker's engine build, in seconds (its stats)."""
    return [s["engine_start_s"] for s in rollout_snapshot(ray, ctl)["workers"].values()]


def measure_tandem(cfg, wl, gpu: bool, address: str | None = None) -> dict:
    """A Tandem job run as `tandem run` runs it (embedded Ray, or the cluster at `address`; its controller), timed
    after the warm-up steps and up to the run's end (END_STEPS). `start_s` says where the time to the first step
    went: the workload's preparation, the actors' start, the first (warm-up) step, each engine's build."""
    from tandem.services.app.run import start_controller, start_ray
    from tandem.services.orchestrator.run_log import rollout_rates

    t_enter = time.time()
    shutil.rmtree(cfg.logging.output_dir, ignore_errors=True)
    ray = start_ray(address, cfg)
    pss = PeakPSS() if not gpu else None
    ctl = start_controller(ray, cfg)
    placed = actor_nodes(ray, ctl)
    start_s = {"prepare": t_enter - T0, "actors": time.time() - t_enter}
    rows, first_step_s, stop, cpu, step_s = [], None, None, None, []
    for i in range(wl["warmup"] + wl["steps"]):
        if i == wl["warmup"]:
            stop, cpu, t_meas, engines = gpu_sampler(), cpu_busy_sampler(), time.time(), rollout_snapshot(ray, ctl)
        t_step = time.time()
        r = ray.get(ctl.step.remote())
        if first_step_s is None:
            first_step_s, start_s["first_step"] = time.time() - T0, time.time() - t_step
            start_s["engines"] = engine_start_s(ray, ctl)
        if i >= wl["warmup"]:
            rows += r["steps"]
            step_s.append(time.time() - t_step)
    wall = time.time() - t_meas
    # the engines over the measured steps: the share of their work stopped past the bound, their step rate and load
    engines = rollout_rates(engines, rollout_snapshot(ray, ctl))
    cores = cpu()
    gpu_stats = stop() if stop else {}
    end_step_s = []  # the run's end, past the measured steps (END_STEPS)
    for _ in range(cfg.batch.max_steps - wl["warmup"] - wl["steps"]):
        t_step = time.time()
        ray.get(ctl.step.remote())
        end_step_s.append(time.time() - t_step)
    ray.get(ctl.shutdown.remote())
    ray.kill(ctl)
    if address is None:
        ray.shutdown()
    def med(key, how=statistics.median):
        vals = [s[key] for s in rows if s.get(key) is not None]
        return how(vals) if vals else None
    top = lambda key: med(key, max)
    per_step = wall / len(rows)
    out = {
        "s_per_step": per_step, "s_per_step_median": statistics.median(step_s), "step_s": step_s,
        "end_step_s": end_step_s,
        "gen_s_per_step": med("rollout_busy_s"), "train_s_per_step": med("train_s"),
        "batch_sampling_s": med("rollout/batch_sampling_s"),  # a batch's groups, first hand-out to last return
        # a batch's share of groups handed out before the batch before it was taken: sampled beside that training
        "sampled_ahead_frac": med("rollout/sampled_ahead_frac"),
        "completions_per_s": wl["prompts"] * wl["num_generations"] * len(rows) / wall,
        # completion tokens trained a second, as the peers' rows count theirs (mean length x completions over the
        # wall); the engine's own per-cycle figure counts a group's tokens in the cycle it finishes, which at
        # max_staleness >= 1 is often a later cycle than the one whose busy time sampled them
        "gen_tokens_per_s": sum(s["completion_length"] for s in rows if s.get("completion_length") is not None)
        * wl["prompts"] * wl["num_generations"] / wall,
        "engine_cycle_tokens_per_s": med("rollout/gen_tokens_per_s"),
        "publish_latency_s": med("publish_latency_s"), "generate_wait_s": med("generate_wait_s"),
        "cycle_s_median": med("cycle_s"), "batches_trained_ahead": top("count/batches_trained_ahead"),
        # since the run's start: groups dropped past max_staleness when they came back, groups stopped mid-sampling
        # for it, and prompts recorded as not trained after their second time (docs/grpo.md §6)
        "stale_dropped": top("count/stale_dropped"), "stale_stopped": top("count/stale_stopped"),
        "stale_failed": top("count/stale_failed"),
        "burst_waits": top("count/burst_waits"),  # polls a take waited for the rest of a burst of groups coming back
        # over the measured steps: the share of the engines' sequence steps that went to groups stopped past the
        # bound, their steps a second of busy time, the sequences a step carried (None: an engine without steps)
        "stale_waste_frac": engines["rollout/stale_waste_frac"],
        # what was trained, not only sampled (docs/grpo.md §6): the run's share of sampled tokens no training took (at
        # its last measured step), each trained token's version lag, sequences updated in flight, prompts never trained,
        # and the tokens the loss saw per completion trained
        "wasted_frac": rows[-1].get("rollout/wasted_frac"), "version_lag_mean": med("rollout/version_lag"),
        "version_lag_max": top("rollout/version_lag_max"),
        "inflight_updated": sum(s.get("rollout/inflight_updated", 0) for s in rows),
        "prompts_never_trained": top("rollout/prompts_never_trained"),
        "trained_tokens_per_completion": (sum(s["rollout/trained_tokens"] for s in rows) /
                                          (wl["prompts"] * wl["num_generations"] * len(rows))
                                          if all("rollout/trained_tokens" in s for s in rows) else None),
        "engine_steps_per_s": engines.get("rollout/engine_steps_per_s"),
        "sequences_per_step": engines.get("rollout/sequences_per_step"),
        # at a step's record, the most prompts in the engines and the most out (in them or finished, not yet trained)
        "prompts_in_flight_max": top("prompts_in_flight"), "prompts_out_max": top("queue_depth"),
        "rollout_busy_frac": med("rollout/busy_frac"), "learner_mfu": med("learner/mfu"),
        "learner_tokens_per_s": med("learner/tokens_per_s"), "launch_to_first_step_s": first_step_s,
        "start_s": start_s,
        "cores_busy": sum(c > 50 for c in cores), "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
        "turns_per_episode": med("episodes/turns_mean"), "tool_calls_per_episode": med("tools/call_frequency"),
        "completion_length_p50": med("completion_length_p50"), "completion_length_p95": med("completion_length_p95"),
        # the learner's layout as its defaults chose it (model.max_tokens_per_forward, checkpointing, Liger, the SMs
        # it left to a colocated engine)
        "forwards_per_step": med("learner/forwards_per_step"),
        "max_tokens_per_forward": med("learner/max_tokens_per_forward"),
        "gradient_checkpointing": med("learner/gradient_checkpointing"), "liger_kernel": med("learner/liger_kernel"),
        "sm_carveout": med("learner/sm_carveout"),
        # the learner process's own peaks (torch's allocator; colocated, the engine's tensors too) beside nvidia-smi's
        "learner_peak_allocated_gib": top("learner/peak_allocated_gib"),
        "learner_peak_reserved_gib": top("learner/peak_reserved_gib"),
        "learner_outside_allocator_gib": top("learner/outside_allocator_gib"),  # CUDA context, NCCL, workspaces
        "engine_shared_gib": med("learner/engine_shared_gib"),  # colocated: frozen weights read from the engine's
        "learner_nodes": placed["learner"], "rollout_nodes": placed["rollout"],
        **{f"learner_{p}_s": med(f"learner/time/{p}_s") for p in ("prepare", "forwards", "finish")},
        # each measured step's split, where a mean hides a long step (which stage it was, what was out)
        "cycles": [{k: r.get(k) for k in CYCLE_KEYS} for r in rows],
    }
    out.update({k2: v for k2, v in gpu_stats.items()})
    if pss is not None:
        out["pss_gb"] = pss.stop()
    return out


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


def run_trl(paths, wl, args, reward=None, tools=None, **config) -> dict:
    """TRL's GRPOTrainer as its users run it: use_vllm=True, vllm_mode="colocate" on GPU (transformers
    generate on CPU, its default), its defaults otherwise; `tools` and more GRPOConfig fields for the agentic
    benchmark (bench/agentic.py)."""
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29600 + os.getpid() % 1000)})
    from datasets import Dataset
    from e2e_reward import ids_reward
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    gpu = on_gpu(args.workload)
    rows = [json.loads(x) for x in Path(paths["data"]).read_text().splitlines()]
    stamps, first = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.time())
            if not first:
                first.append(time.time() - T0)

    n = wl["warmup"] + wl["steps"]
    conf = dict(output_dir=str(Path(args.dir) / "trl"), per_device_train_batch_size=wl["per_device"],
                gradient_accumulation_steps=wl["ga"], num_generations=wl["num_generations"],
                max_completion_length=wl["max_tokens"], max_steps=n, learning_rate=wl["lr"],
                lr_scheduler_type="constant", temperature=1.0, beta=0.0, loss_type="dapo", logging_steps=1,
                report_to="none", save_strategy="no", seed=42, shuffle_dataset=not in_order(wl), **config)
    if gpu:
        conf.update(bf16=True, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory or TRL_VLLM_MEMORY)
    else:
        conf.update(use_cpu=True, bf16=False)
    lora = wl["lora"]
    peft = LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"], target_modules=lora.get("target_modules") or "all-linear",
                      task_type="CAUSAL_LM")
    lengths: list[tuple[int, list[int]]] = []  # (optimizer steps done, each completion's length) per reward call
    scored = reward or ids_reward

    @functools.wraps(scored)  # TRL logs a reward by its function's name
    def measured(*a, completion_ids=None, **k):
        if completion_ids is not None:
            lengths.append((len(stamps), [len(c) for c in completion_ids]))
        return scored(*a, completion_ids=completion_ids, **k)

    tr = GRPOTrainer(model=paths["model"], reward_funcs=measured, args=GRPOConfig(**conf),
                     train_dataset=Dataset.from_list(rows), peft_config=peft,
                     processing_class=AutoTokenizer.from_pretrained(paths["model"]), **({"tools": tools} if tools else {}))
    stop = [None]
    pss = PeakPSS() if not gpu else None

    class Start(TrainerCallback):
        def on_step_end(self, state_args, state, *a, **k):
            if state.global_step == wl["warmup"]:
                stop[0] = gpu_sampler()
    tr.add_callback(Clock())
    tr.add_callback(Start())
    tr.train()
    g = stop[0]() if stop[0] else {}
    meas = stamps[wl["warmup"]:]
    wall = meas[-1] - stamps[wl["warmup"] - 1]
    steps = len(meas)
    logs = [h for h in tr.state.log_history if "loss" in h][wl["warmup"]:]
    comp_len = statistics.mean(h.get("completions/mean_length", 0) for h in logs) if logs else None
    C = wl["prompts"] * wl["num_generations"]
    out = {"s_per_step": wall / steps, "gen_s_per_step": None, "train_s_per_step": None,
           "completions_per_s": C * steps / wall,
           "gen_tokens_per_s": (comp_len * C * steps / wall) if comp_len else None, "publish_latency_s": None,
           "launch_to_first_step_s": first[0] if first else None,
           "reward_first": logs[0].get("reward") if logs else None, "reward_last": logs[-1].get("reward") if logs else None,
           "learner_mfu": None, **length_percentiles([n for done, ns in lengths if done >= wl["warmup"] for n in ns], wl["max_tokens"]),
           **g}
    calls = [h["tools/call_frequency"] for h in logs if "tools/call_frequency" in h]
    if calls:  # TRL logs calls per episode; each call is followed by a turn
        out["tool_calls_per_episode"] = statistics.median(calls)
        out["turns_per_episode"] = 1 + out["tool_calls_per_episode"]
    if pss is not None:
        out["pss_gb"] = pss.stop()
    return out


TRL_ASYNC_PORT = 8765
TRL_ASYNC_STALENESS = 4  # AsyncGRPOConfig's default max_staleness: its own setting for throughput


def start_vllm_server(model: str, wl: dict, args, max_loras: int) -> subprocess.Popen:
    """`vllm serve` as TRL's AsyncGRPOTrainer documents it for LoRA on one node: its runtime LoRA loading and the dev
    routes on (VLLM_ALLOW_RUNTIME_LORA_UPDATING, VLLM_SERVER_DEV_MODE), a LoRA slot per policy version requests may
    still name (TRL refuses fewer: max_staleness + 2), its share of the one GPU (the trainer is beside it)."""
    import urllib.request

    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
               VLLM_USE_FLASHINFER_SAMPLER="0")  # flashinfer is not among the GPU wheels (as bench/plateau.py)
    max_len = model_len(wl)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(TRL_ASYNC_PORT),
           "--dtype", wl["model"]["dtype"], "--gpu-memory-utilization", str(args.vllm_memory or TRL_VLLM_MEMORY),
           "--enable-lora", "--max-lora-rank", str(max(16, wl["lora"]["r"])), "--max-loras", str(max_loras),
           "--max-model-len", str(max_len)]
    if not on_gpu_machine():  # vLLM-CPU cannot rewind a seeded request's generator after a partial prefill (TRL seeds
        # every request): a step's token budget that holds every sequence's whole prompt leaves none partial
        cmd += ["--max-num-seqs", "64", "--max-num-batched-tokens", str(64 * max_len)]
    log = open(Path(args.dir) / "vllm_server.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    end = time.time() + 900
    while time.time() < end:
        if server.poll() is not None:
            raise RuntimeError("vllm serve exited: " + Path(log.name).read_text()[-3000:])
        try:
            urllib.request.urlopen(f"http://localhost:{TRL_ASYNC_PORT}/health", timeout=5)
            return server
        except OSError:
            time.sleep(2)
    server.kill()
    raise RuntimeError("vllm serve not ready within 900 s: " + Path(log.name).read_text()[-3000:])


# TRL's AsyncGRPOTrainer samples conversations only (a prompt is a message list it renders with the tokenizer's chat
# template, whose response format it must know). A workload of text prompts goes to it as one user message under a
# template that renders exactly that text, and a response format of plain text: the same prompt tokens every other
# candidate samples from (Qwen2.5's own template would put the long-tail marker mid-prompt, which the warm-up did not
# teach).
AS_TEXT_TEMPLATE = "{{ messages[0]['content'] }}"
AS_TEXT_RESPONSE = {"defaults": {"role": "assistant"}, "fields": {"content": {"content": "text"}}}


def as_conversations(rows: list[dict], tok) -> list[dict]:
    """The rows for AsyncGRPOTrainer: text prompts as one-message conversations, `tok` set to render them as the text
    (AS_TEXT_TEMPLATE); conversations as they are, with the response format TRL knows for `tok`'s chat template (its
    tool-call parsing), else the whole completion as the answer's text."""
    if rows and not isinstance(rows[0]["prompt"], str):
        from trl.chat_template_utils import add_response_schema

        try:
            add_response_schema(tok)
        except ValueError:  # a template TRL does not know (the CPU workload's own)
            tok.response_template = AS_TEXT_RESPONSE
        return rows
    tok.chat_template, tok.response_template = AS_TEXT_TEMPLATE, AS_TEXT_RESPONSE
    return [dict(r, prompt=[{"role": "user", "content": r["prompt"]}]) for r in rows]


def hf_kernels():
    """Hugging Face's `kernels` package, imported with this checkout's own kernels/ folder (on sys.path for `tandem`)
    kept from standing in for it; TRL's later `from kernels import get_kernel` finds it in sys.modules."""
    import importlib

    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    ours = sys.modules.get("kernels")
    if ours is not None and ROOT in Path(getattr(ours, "__file__", None) or "/").resolve().parents:
        del sys.modules["kernels"]  # imported by that name through the checkout (a library probing for the package)
    try:
        return importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


def trl_async_blocker() -> str | None:
    """Why TRL's AsyncGRPOTrainer cannot train on this machine, in its own error, or None. It trains with
    attn_implementation "tree_fa3", whose flash-attention kernel Hugging Face's `kernels` package fetches from the Hub
    (`get_kernel("kernels-community/flash-attn3")`, trl/experimental/async_grpo/packing.py) on the first forward,
    minutes into a run: asked here first."""
    try:
        hf_kernels()
        from trl.experimental.async_grpo.packing import _flash_attn

        _flash_attn.cache_clear()
        _flash_attn()
    except Exception as e:  # noqa: BLE001 - whatever stops it, said as it is
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


# Where the Hub's FlashAttention-3 kernel cannot be had, TRL's AsyncGRPOTrainer runs on this local stand-in (torch's
# varlen FlashAttention-2; its module docstring), through the `kernels` package's own LOCAL_KERNELS override.
TRL_ASYNC_ATTENTION = ROOT / "bench" / "trl_async_attention"
FA3_REPO = "kernels-community/flash-attn3"


def trl_async_attention() -> str:
    """The attention TRL's AsyncGRPOTrainer will run with here, said for its row: the Hub's FA3 kernel where it
    loads, else the local stand-in (LOCAL_KERNELS set for this process and its children); SystemExit where neither."""
    hub = trl_async_blocker()
    if hub is None:
        return "FlashAttention-3 (kernels-community/flash-attn3), as TRL runs it"
    os.environ["LOCAL_KERNELS"] = f"{FA3_REPO}={TRL_ASYNC_ATTENTION}"
    local = trl_async_blocker()
    if local is not None:
        raise SystemExit(f"trl_async: TRL's AsyncGRPOTrainer cannot train here: its attention (tree_fa3) needs Hugging "
                         f"Face's `kernels` package and the {FA3_REPO} kernel, which said {hub!r} from the Hub and "
                         f"{local!r} from the local stand-in {TRL_ASYNC_ATTENTION}")
    how = "torch's varlen FlashAttention-2" if on_gpu_machine() else "masked attention per segment (no GPU)"
    return (f"bench/trl_async_attention in place of {FA3_REPO} (not reachable here: {hub}): {how}, through "
            f"LOCAL_KERNELS")


def run_trl_async(paths, wl, args, reward=None, tools=None, **config) -> dict:
    """TRL's AsyncGRPOTrainer as its users run it on one node: a vLLM server generating while the trainer trains, the
    adapter synced to it after every step, its own defaults for staleness and in-flight requests (said in the
    result). Reward: module-level functions (its rewards and tools run in a spawned child, so a closure cannot):
    ids_reward, or `reward` with `tools` and more AsyncGRPOConfig fields for the agentic benchmark."""
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29600 + os.getpid() % 1000), "TRL_EXPERIMENTAL_SILENCE": "1"})
    from datasets import Dataset
    from e2e_reward import ids_reward
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    attention = trl_async_attention()
    staleness = wl.get("trl_async_staleness", TRL_ASYNC_STALENESS)
    server = start_vllm_server(paths["model"], wl, args, max_loras=staleness + 2)
    try:
        tok = AutoTokenizer.from_pretrained(paths["model"])
        rows = as_conversations([json.loads(x) for x in Path(paths["data"]).read_text().splitlines()], tok)
        stamps = []

        class Clock(TrainerCallback):
            def on_step_end(self, *a, **k):
                stamps.append(time.time())
                if len(stamps) == wl["warmup"]:
                    stop[0] = gpu_sampler()
        stop = [None]
        n = wl["warmup"] + wl["steps"]
        conf = AsyncGRPOConfig(
            output_dir=str(Path(args.dir) / "trl_async"), per_device_train_batch_size=wl["per_device"],
            gradient_accumulation_steps=wl["ga"], num_generations=wl["num_generations"],
            max_completion_length=wl["max_tokens"], max_steps=n, learning_rate=wl["lr"], lr_scheduler_type="constant",
            temperature=1.0, logging_steps=1, report_to="none", save_strategy="no", seed=42,
            dtype=wl["model"]["dtype"], bf16=wl["model"]["dtype"] == "bfloat16",
            vllm_server_base_url=f"http://localhost:{TRL_ASYNC_PORT}", max_staleness=staleness,
            gradient_checkpointing=wl.get("gradient_checkpointing", True),
            token_budget=0,  # per_device x ga samples a step, the batch every candidate trains (its default packs
            **config)        # rows to a token budget: a step's sample count then varies with the lengths)
        lora = wl["lora"]
        peft = LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"],
                          target_modules=lora.get("target_modules") or "all-linear", task_type="CAUSAL_LM")
        tr = AsyncGRPOTrainer(model=paths["model"], reward_funcs=reward or ids_reward, args=conf,
                              train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=peft,
                              callbacks=[Clock()],
                              **({"tools": tools} if tools else {}))
        tr.train()
        g = stop[0]() if stop[0] else {}
    finally:
        server.terminate()
        server.wait(timeout=60)
    meas = stamps[wl["warmup"]:]
    wall = meas[-1] - stamps[wl["warmup"] - 1]
    logs = [h for h in tr.state.log_history if "loss" in h][wl["warmup"]:]
    comp_len = statistics.mean(h.get("completions/mean_length", 0) for h in logs) if logs else None
    # the samples each step trained, as it logs them (a token budget would make them vary)
    asked = wl["prompts"] * wl["num_generations"]
    trained = sum(h.get("batch/samples_per_step", asked) for h in logs) if logs else asked * len(meas)
    calls = [h["tools/call_frequency"] for h in logs if "tools/call_frequency" in h]
    episodes = {"tool_calls_per_episode": statistics.median(calls), "turns_per_episode": 1 + statistics.median(calls)} \
        if calls else {}
    return {"s_per_step": wall / len(meas), "gen_s_per_step": None, "train_s_per_step": None, **episodes,
            **trl_async_trained(logs),
            "completions_per_s": trained / wall, "samples_per_step": trained / len(meas),
            "gen_tokens_per_s": comp_len * trained / wall if comp_len else None, "publish_latency_s": None,
            "learner_mfu": None,
            "reward_first": logs[0].get("reward") if logs else None,
            "reward_last": logs[-1].get("reward") if logs else None,
            "settings": f"AsyncGRPOTrainer defaults: max_staleness {staleness}, max_inflight_tasks auto, its own loss "
                        f"(AsyncGRPOConfig has no loss_type or beta), but token_budget 0 (the candidates' batch: "
                        f"per_device_train_batch_size x gradient_accumulation_steps samples a step); vLLM server at "
                        f"gpu_memory_utilization {args.vllm_memory or TRL_VLLM_MEMORY}; attention: {attention}", **g}


def trl_async_trained(logs: list[dict]) -> dict:
    """What TRL's AsyncGRPOTrainer logs of what it trained, in the keys of Tandem's rows: its masked token share
    (`batch/masked_token_frac`, the mean over the measured steps: the only waste it logs; samples it drops past its
    max_staleness are logged at info level only), trained tokens per completion (`sample/trained_tokens_mean`) and
    its staleness (`sample/staleness_mean`, `_max`); None where it does not log them."""
    def mean(key):
        vals = [h[key] for h in logs if key in h]
        return statistics.mean(vals) if vals else None
    top = max((h["sample/staleness_max"] for h in logs if "sample/staleness_max" in h), default=None)
    return {"wasted_frac": mean("batch/masked_token_frac"), "trained_tokens_per_completion": mean(
        "sample/trained_tokens_mean"), "version_lag_mean": mean("sample/staleness_mean"), "version_lag_max": top}


# --------------------------------------------------------------------------------------- table


def versions() -> dict:
    out = {}
    for name in ("torch", "vllm", "ray", "deepspeed", "trl", "transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - not installed here
            pass
    return out


def pipeline_efficiency(run: dict, synchronous: dict | None) -> float | None:
    """A candidate's seconds a step over the larger of the step's generation alone and its training alone, both
    from the same workload's `max_staleness: 0` run (Tandem's, where neither overlaps the other): 1.0 is a
    pipeline with no bubble; a synchronous loop is near the sum over the larger."""
    if not synchronous or not synchronous.get("generate_wait_s") or not synchronous.get("train_s_per_step"):
        return None
    return run["s_per_step"] / max(synchronous["generate_wait_s"], synchronous["train_s_per_step"])


def pipeline_efficiency_tokens(run: dict, synchronous: dict | None) -> float | None:
    """The same counted in trained completion tokens: the `max_staleness: 0` run's tokens a step over the larger of
    its generation alone and its training alone, against the candidate's tokens a second. An asynchronous batch takes
    the groups that finish first, so in a short run it trains shorter completions than a synchronous one, and its
    step time alone reads better than its work; the tokens do not depend on that mix. Equal to pipeline_efficiency
    for the `max_staleness: 0` run itself."""
    if pipeline_efficiency(run, synchronous) is None or not run.get("gen_tokens_per_s") \
            or not synchronous.get("gen_tokens_per_s"):
        return None
    per_step = synchronous["gen_tokens_per_s"] * synchronous["s_per_step"]
    alone = per_step / max(synchronous["generate_wait_s"], synchronous["train_s_per_step"])
    return alone / run["gen_tokens_per_s"]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing (or b is 0)."""
    return a / b if a and b else None


def sharing_speeds(run: dict, synchronous: dict | None) -> dict:
    """What sharing the device costs each side, against the `max_staleness: 0` run (where each runs alone): the
    engine's trained tokens a second of its busy time (tokens a second over the share of the run it had requests),
    and the learner's forwards' speed, each as a share of its speed alone (1.0: no slowdown). Their sum is what the
    pair gets out of the device: 2.0 would be two devices."""
    if not synchronous or run is synchronous:
        return {}
    busy = lambda r: ratio(r.get("gen_tokens_per_s"), r.get("rollout_busy_frac"))  # noqa: E731
    return {"engine_x_alone": ratio(busy(run), busy(synchronous)),
            "learner_x_alone": ratio(synchronous.get("learner_forwards_s"), run.get("learner_forwards_s"))}


ASYNC_PEER = "trl_async"  # the asynchronous baseline: its column leads the table's ratios


def stale_counts(run: dict) -> str:
    """A Tandem run's groups stopped past max_staleness, dropped past it, and prompts recorded for it (None: a counter
    that never moved, 0); — for a count the run's JSON does not have (a peer's, or one recorded before it was)."""
    keys = ("stale_stopped", "stale_dropped", "stale_failed")
    if not any(k in run for k in keys):
        return "—"
    counts = " / ".join(str(int(run[k] or 0)) if k in run else "—" for k in keys)
    waste = run.get("stale_waste_frac")  # the engines' work they took over the run (recorded since 2026-12-06)
    return counts if waste is None else f"{counts} ({waste:.0%} of the engine)"


def pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def table(out_dir: Path, names: list[str], ceiling: str | None, peer: str,
          k0: Path | None = None, elsewhere: dict[str, Path] | None = None) -> tuple[str, dict]:
    """k0: the `max_staleness: 0` run the efficiencies are read against, where it is not among these (another
    call's run of the same workload on the same card: the results page says which). elsewhere: {candidate: JSON}
    run in another call (the same workload and card kind), a row marked † (its ratios span two calls)."""
    elsewhere = elsewhere or {}
    c = {n: json.loads((out_dir / f"{n}.json").read_text()) for n in names if (out_dir / f"{n}.json").is_file()}
    c.update({n: json.loads(Path(p).read_text()) for n, p in elsewhere.items()})
    synchronous = json.loads(k0.read_text()) if k0 else c.get("tandem_k0")
    for r in c.values():
        r["pipeline_efficiency"] = pipeline_efficiency(r, synchronous)
        r["pipeline_efficiency_tokens"] = pipeline_efficiency_tokens(r, synchronous)
        r.update(sharing_speeds(r, synchronous))
    fmt = lambda v, p=2: "—" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
    cpu = any(r.get("pss_gb") is not None for r in c.values())  # CPU: memory as PSS, launch time, cores
    extra = " launch → first step s | peak PSS GB | cores > 50% |" if cpu else ""
    # gen tok/s: completion tokens trained a second, as each candidate counts them (the tokens' ratio beside the
    # completions': the candidates may train different mixes of lengths)
    lines = ["| candidate | s/step | gen s/step | train s/step | pipeline efficiency | (by tokens) | engine × alone "
             "| learner × alone | completions/s | × " + ASYNC_PEER + " | × " + peer + " | gen tok/s | tok × " + ASYNC_PEER
             + " | × ceiling | GPU busy | peak GPU GiB | publish s | stale stopped / dropped / failed | wasted "
             "| trained tok / completion | lag mean / max | updated in flight |" + extra,
             "|" + " --- |" * (25 if cpu else 22)]
    for n, r in c.items():
        x_peer = r["completions_per_s"] / c[peer]["completions_per_s"] if peer in c else None
        x_async = r["completions_per_s"] / c[ASYNC_PEER]["completions_per_s"] if ASYNC_PEER in c else None
        tok_async = ratio(r.get("gen_tokens_per_s"), c.get(ASYNC_PEER, {}).get("gen_tokens_per_s"))
        x_ceil = (r["gen_tokens_per_s"] / c[ceiling]["gen_tokens_per_s"]
                  if ceiling in c and r.get("gen_tokens_per_s") and n != ceiling else None)
        row = (f"| {n}{' †' if n in elsewhere else ''} | {fmt(r['s_per_step'], 3)} | {fmt(r.get('gen_s_per_step'))} | "
               f"{fmt(r.get('train_s_per_step'))} | {fmt(r.get('pipeline_efficiency'))} | "
               f"{fmt(r.get('pipeline_efficiency_tokens'))} | "
               f"{fmt(r.get('engine_x_alone'))} | {fmt(r.get('learner_x_alone'))} | "
               f"{fmt(r['completions_per_s'], 1)} | {fmt(x_async)} | {fmt(x_peer)} | "
               f"{fmt(r.get('gen_tokens_per_s'), 0)} | {fmt(tok_async)} | {fmt(x_ceil)} | "
               f"{fmt(r.get('gpu_busy_frac'))} | "
               f"{fmt(r.get('peak_gpu_gib'), 1)} | {fmt(r.get('publish_latency_s'), 3)} | {stale_counts(r)} | "
               f"{pct(r.get('wasted_frac'))} | {fmt(r.get('trained_tokens_per_completion'), 0)} | "
               f"{fmt(r.get('version_lag_mean'))} / {fmt(r.get('version_lag_max'), 0)} | "
               f"{fmt(r.get('inflight_updated'), 0)} |")
        if cpu:
            row += (f" {fmt(r.get('launch_to_first_step_s'), 1)} | {fmt(r.get('pss_gb'))} |"
                    f" {fmt(r.get('cores_busy'))} |")
        lines.append(row)
    lines += [f"† {n}: {p}" for n, p in elsewhere.items()]
    return "\n".join(lines), c


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


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("candidate", choices=list(TANDEM) + list(TANDEM_NODES) + ["vllm_ceiling", "vllm_merged",
                                                                               "trl_colocate", "trl", "trl_async"])
    r.add_argument("--workload", default="gpu", choices=list(WORKLOADS))
    r.add_argument("--dir", default="/tmp/tandem-e2e")
    r.add_argument("--json", required=True)
    r.add_argument("--rollout-gpus", type=float, default=0.4, help="Ray GPUs of the rollout worker")
    r.add_argument("--learner-gpus", type=float, default=0.4, help="Ray GPUs of the learner")
    r.add_argument("--vllm-memory", type=float, default=None,
                   help="vllm_gpu_memory_utilization of every candidate; default: Tandem's (auto), TRL's (0.3) for "
                        "TRL and the ceiling")
    r.add_argument("--set", action="extend", nargs="+", default=[], help="workload key=value ... (e.g. prompts=8)")
    t = sub.add_parser("table")
    t.add_argument("out_dir")
    t.add_argument("--names", default="tandem_k0,tandem_k1,tandem_k4,vllm_ceiling,vllm_merged,trl_colocate,trl_async")
    t.add_argument("--ceiling", default="vllm_ceiling")
    t.add_argument("--peer", default="trl_colocate")
    t.add_argument("--k0", type=Path, default=None,
                   help="a tandem_k0 JSON from another call of the same workload and card, for the efficiencies")
    t.add_argument("--from", dest="elsewhere", action="append", default=[], metavar="NAME=PATH",
                   help="a candidate's JSON from another call of the same workload and card kind (its row marked †)")
    a = ap.parse_args()
    if a.cmd == "table":
        text, c = table(Path(a.out_dir), a.names.split(","), a.ceiling, a.peer, a.k0,
                        dict(kv.split("=", 1) for kv in a.elsewhere))
        print(text)
        return
    a.dir, a.json = use_this_checkout(a.dir, a.json)
    wl = workload(WORKLOADS, a.workload, a.set)
    a.dir = str(Path(a.dir) / workload_dir(a.workload, wl))
    paths = prepare(Path(a.dir), wl)
    machine = host_state()
    if a.candidate in TANDEM:
        k, mode, vllm = TANDEM[a.candidate]
        res = run_tandem(paths, wl, k, a, mode, vllm)
        keep_group_trace(Path(a.dir) / f"run-k{k}", Path(a.json))
    elif a.candidate in TANDEM_NODES:
        res = run_tandem_nodes(paths, wl, TANDEM_NODES[a.candidate], a)
    elif a.candidate == "trl_async":
        res = run_trl_async(paths, wl, a)
    else:
        res = run_vllm(paths, wl, a, lora=a.candidate == "vllm_ceiling") if a.candidate.startswith("vllm_") \
            else run_trl(paths, wl, a)
    # under CUDA MPS (bench/device/with_mps.sh), the processes' kernels run side by side
    res.update(candidate=a.candidate, workload=a.workload, versions=versions(), wl=wl, host=machine,
               cuda_mps="CUDA_MPS_PIPE_DIRECTORY" in os.environ)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res.get(k) for k in KEYS + ("launch_to_first_step_s", "start_s", "pss_gb", "rollout_busy_frac",
                                                       "learner_mfu", "reward_first", "reward_last",
                                                       "peak_gpu_gib_by_process", "host")}), flush=True)


if __name__ == "__main__":
    main()
