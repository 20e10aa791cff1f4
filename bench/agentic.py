"""The agentic benchmark: tool-calling GRPO, side by side on one workload. Tandem `max_staleness` 0, 1 and 4 (`tools:`;
4 also with the engine in the learner's process, `tandem_k4_colocate`), TRL's `GRPOTrainer(tools=[add])` with vLLM
colocated (TRL's tool loop as its users run it) and TRL's `AsyncGRPOTrainer(tools=[add])` beside a vLLM server on the
same GPU (`trl_async`, bench/e2e.py), the same model, data, tool, reward, LoRA, batch and sampling. The model has
Qwen2.5-0.5B's shape and vocabulary size with Qwen2.5's chat template (TRL ships it:
trl/chat_templates/qwen2_5.jinja, so TRL parses its tool calls), warmed up in the prepare step by a short supervised
stage to answer "what is a + b + c (+ d) ?" by calling `add` once per turn (2-3 tool turns), the tool an async
function sleeping a seeded 0.2-1 s per call (bench/agentic_task.py).

  python3 bench/agentic.py prepare --workload gpu|cpu --dir WORK
  python3 bench/agentic.py run CANDIDATE --workload gpu|cpu --dir WORK --json OUT.json
  python3 bench/agentic.py table OUT_DIR        # bench/results/agentic_<workload>.{md,json}'s table
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import e2e_table  # noqa: E402
import machine  # noqa: E402
import tandem_candidates  # noqa: E402
import trl_candidates  # noqa: E402
import workloads  # noqa: E402

TASK = f"{ROOT}/bench/agentic_task.py"
WORKLOADS = {
    "gpu": dict(model=workloads.SHAPES["0.5b"],
                lora=dict(r=16, lora_alpha=32), prompts=16, num_generations=8, max_tokens=320, per_device=32,
                ga=4, steps=6, warmup=2, lr=1e-5, max_iterations=4, sft_steps=400, sft_batch=16, sft_lr=3e-4),
    "cpu": dict(model=workloads.SHAPES["tiny"],
                lora=workloads.TINY_LORA,
                prompts=2, num_generations=8, max_tokens=200, per_device=16, ga=1, steps=4, warmup=1, lr=1e-4,
                max_iterations=4, sft_steps=120, sft_batch=8, sft_lr=3e-3),
}
# tandem_k4: the staleness bound trl_async runs at by default (bench/trl_candidates.py TRL_ASYNC_STALENESS);
# _colocate: the engine in the learner's process (cluster.vllm_mode colocate: one CUDA context, the learner's matmuls
# leaving SMs free)
CANDIDATES = ("tandem_k0", "tandem_k1", "tandem_k4", "tandem_k4_colocate", "trl_tools", "trl_async")


# ------------------------------------------------------------------------------------ workload


def question(rng: random.Random) -> tuple[str, list[int]]:
    xs = [rng.randint(1, 60) for _ in range(rng.choice((3, 4)))]
    return "what is " + " + ".join(map(str, xs)) + " ?", xs


def qwen_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def sft_episode(tok, template, tools, rng) -> tuple[list[int], list[int]]:
    """One warm-up episode as the rollout worker concatenates them: add(first, second), then add(that sum, next),
    ..., then the sum; the model's turns trained on, the tool turns not."""
    from tandem.services.devtools.tiny_model import TOOL_CALL, TOOL_CALL_END

    q, xs = question(rng)
    ids = list(tok.apply_chat_template([{"role": "user", "content": q}], tools=tools, add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"])
    mask = [0] * len(ids)
    total = xs[0]
    for x in xs[1:]:
        call = json.dumps({"name": "add", "arguments": {"a": total, "b": x}})
        turn = tok(f"{TOOL_CALL}\n{call}\n{TOOL_CALL_END}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        total += x
        result = template.suffix_ids([{"role": "tool", "name": "add", "content": str(total)}])
        ids += turn + result
        mask += [1] * len(turn) + [0] * len(result)
    answer = tok(str(total), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids + answer, mask + [1] * len(answer)


def warm_up(model_dir: Path, wl: dict) -> float:
    import torch
    from agentic_task import add
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.rollout.episodes import ToolTurnTemplate
    from tandem.rollout.tools import tool_schemas
    from tandem.services.devtools.warm_up import sft_step

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    template, tools = ToolTurnTemplate(tok, str(model_dir)), tool_schemas([add])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=wl["sft_lr"])
    rng = random.Random(0)
    model.train()
    for _ in range(wl["sft_steps"]):
        seqs, masks = zip(*(sft_episode(tok, template, tools, rng) for _ in range(wl["sft_batch"])))
        loss = sft_step(model, opt, seqs, masks, tok.pad_token_id, dev, bf16=dev == "cuda")
    model.to(getattr(torch, wl["model"]["dtype"])).save_pretrained(model_dir)
    return float(loss)


def prepare(work: Path, wl: dict) -> dict:
    """Model (built, given Qwen2.5's template, warmed up) and prompts under `work`, once for every candidate."""
    from tandem.services.devtools.tiny_model import build_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    m, model = wl["model"], work / "model"
    if not (model / "warm.json").is_file():
        t0 = time.time()
        build_tiny_model(model, layers=m["layers"], hidden=m["hidden"], heads=m["heads"], kv_heads=m["kv_heads"],
                         intermediate=m["intermediate"], vocab=m["vocab"], tie_word_embeddings=m["tie"],
                         dtype=m["dtype"], seed=0, max_position_embeddings=2048, tool_tokens=True)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        tok.chat_template = qwen_template()
        tok.save_pretrained(model)
        loss = warm_up(model, wl)
        (model / "warm.json").write_text(json.dumps({"sft_loss": loss, "seconds": time.time() - t0}))
        print(f"prepare: model warmed up in {time.time() - t0:.0f} s (SFT loss {loss:.3f})", flush=True)
    rng = random.Random(1)
    data = work / "prompts.jsonl"
    rows = []
    for _ in range(wl["prompts"] * (wl["steps"] + wl["warmup"] + 2)):
        q, xs = question(rng)
        rows.append({"prompt": [{"role": "user", "content": q}], "answer": sum(xs)})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(model), "data": str(data)}


# ---------------------------------------------------------------------------------- candidates


def tandem_job(paths, wl, k, args, mode="server"):
    from tandem.core.config import JobConfig

    gpu = args.workload == "gpu"
    res = lambda g: {"num_cpus": 1, "num_gpus": g}  # noqa: E731
    return JobConfig.from_dict({
        "model": {"path": paths["model"], "dtype": wl["model"]["dtype"], "lora": wl["lora"],
                  "gradient_checkpointing": wl.get("tandem_checkpointing", "auto")},  # --set tandem_checkpointing=true
        "data": {"path": paths["data"]}, "rewards": [f"{TASK}:correct_sum"], "tools": [f"{TASK}:add"],
        "tool_timeout_s": 10,
        "generation": {"temperature": 1.0, "max_prompt_length": 768, "max_completion_length": wl["max_tokens"],
                       "max_tool_calling_iterations": wl["max_iterations"]},
        "batch": {"per_device_train_batch_size": wl["per_device"], "gradient_accumulation_steps": wl["ga"],
                  "num_generations": wl["num_generations"], "max_steps": wl["steps"] + wl["warmup"]
                  + tandem_candidates.END_STEPS},
        "grpo": {"loss_type": "dapo", "beta": 0.0},
        "optimizer": {"learning_rate": wl["lr"], "lr_scheduler_type": "constant"},
        "cluster": {"num_rollout_workers": 1, "max_staleness": k, "vllm_mode": mode,
                    "inflight_updates": wl.get("inflight_updates", True),  # --set inflight_updates=false: pinned
                    "rollout_resources": res(args.rollout_gpus if gpu else 0),
                    "learner_resources": res(args.learner_gpus if gpu else 0),
                    "vllm_gpu_memory_utilization": args.vllm_memory},
        "logging": {"output_dir": str(Path(args.dir) / f"run-k{k}"), "progress": False},
    })


def run(candidate: str, paths, wl, args) -> dict:
    if candidate.startswith("tandem_k"):
        k, _, mode = candidate.removeprefix("tandem_k").partition("_")
        return tandem_candidates.measure_tandem(tandem_job(paths, wl, int(k), args, mode or "server"), wl,
                                                args.workload == "gpu")
    from agentic_task import add, correct_sum

    # TRL's asynchronous trainer, or its own
    runner = trl_candidates.run_trl_async if candidate == "trl_async" else trl_candidates.run_trl
    return runner(paths, wl, args, reward=correct_sum, tools=[add], max_tool_calling_iterations=wl["max_iterations"])


KEYS = ("completions_per_s", "s_per_step", "turns_per_episode", "tool_calls_per_episode", "gpu_busy_frac",
        "peak_gpu_gib")


def table(out: Path) -> str:
    """The candidates side by side, led by the ratio to TRL's asynchronous trainer (trl_async), then to its
    synchronous one (trl_tools)."""
    c = {n: json.loads((out / f"{n}.json").read_text()) for n in CANDIDATES if (out / f"{n}.json").is_file()}
    fmt = lambda v, p=2: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    ratio = lambda r, peer: r["completions_per_s"] / c[peer]["completions_per_s"] if peer in c else None  # noqa: E731
    # what was trained beside what was sampled: groups dropped past the bound, the share of sampled tokens no training
    # took (TRL's masked share counts the tool results' tokens too, which no trainer trains: not comparable), the
    # model's tokens trained per completion, each trained token's version lag
    lines = ["| candidate | completions/s | × trl_async | × trl_tools | s/step | turns/episode | tool calls/episode | "
             "GPU busy | peak GPU GiB | reward first → last | groups dropped | wasted | trained tok / completion | "
             "lag mean / max |", "|" + " --- |" * 14]
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for n, r in c.items():
        lines.append(f"| {n} | {fmt(r['completions_per_s'], 1)} | {fmt(ratio(r, 'trl_async'))} | "
                     f"{fmt(ratio(r, 'trl_tools'))} | {fmt(r['s_per_step'], 2)} | "
                     f"{fmt(r.get('turns_per_episode'))} | {fmt(r.get('tool_calls_per_episode'))} | "
                     f"{fmt(r.get('gpu_busy_frac'))} | {fmt(r.get('peak_gpu_gib'), 1)} | "
                     f"{fmt(r.get('reward_first'))} → {fmt(r.get('reward_last'))} | "
                     f"{r.get('stale_dropped', '—')} | {pct(r.get('wasted_frac'))} | "
                     f"{fmt(r.get('trained_tokens_per_completion'), 0)} | "
                     f"{fmt(r.get('version_lag_mean'))} / {fmt(r.get('version_lag_max'), 0)} |")
    (out / "agentic.json").write_text(json.dumps({"candidates": {n: {k: r.get(k) for k in KEYS + (
        "reward_first", "reward_last", "launch_to_first_step_s", "settings", "stale_dropped", "wasted_frac",
        "trained_tokens_per_completion", "version_lag_mean", "version_lag_max")} for n, r in c.items()}}, indent=1))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("prepare", "run", "table"))
    ap.add_argument("candidate", nargs="?", choices=CANDIDATES)
    ap.add_argument("--workload", default="gpu", choices=list(WORKLOADS))
    ap.add_argument("--dir", default="/tmp/tandem-agentic")
    ap.add_argument("--json")
    ap.add_argument("--out", help="table: the folder of the candidates' JSON files")
    ap.add_argument("--rollout-gpus", type=float, default=0.4)
    ap.add_argument("--learner-gpus", type=float, default=0.4)
    ap.add_argument("--vllm-memory", type=float, default=0.3)
    ap.add_argument("--set", action="append", default=[], help="workload key=value")
    a = ap.parse_args()
    if a.cmd == "table":
        print(table(Path(a.out)))
        return
    a.dir, a.json = workloads.use_this_checkout(a.dir, a.json)
    wl = workloads.workload(WORKLOADS, a.workload, a.set)
    paths = prepare(Path(a.dir), wl)
    if a.cmd == "prepare":
        return
    host = machine.host_state()
    res = run(a.candidate, paths, wl, a)
    res.update(candidate=a.candidate, workload=a.workload, versions=e2e_table.versions(), wl=wl, host=host)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res.get(k) for k in KEYS + ("reward_first", "reward_last", "launch_to_first_step_s", "host")}),
          flush=True)


if __name__ == "__main__":
    main()
