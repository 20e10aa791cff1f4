"""Learning, measured: eval reward against wall-clock and against step, Tandem beside TRL's GRPOTrainer, on a task
a model learns here with a reward a checker computes (no judge).

The task is the demo's (examples/sevens): a 2-layer Qwen2-shaped model warmed up on random digit strings, rewarded
by the fraction of its characters that are 7. Every candidate trains the same model, data, reward, batch (4 prompts
x 8 completions a step), learning rate, LoRA and loss (dapo, beta 0) from the same start; each is evaluated every
`--eval-every` steps on the demo's six eval prompts, 64 completions each at temperature 1, with the policy it samples
with (Tandem: its own evaluation, vLLM with the adapter its rollout worker serves; TRL: transformers' sampling with
the model it trains, no top-k or top-p, as vLLM samples). Evaluation time is left out of the wall-clock; start-up
(Ray, the engines) is in it, as a user waits for it.

  python bench/learning.py run --candidates trl_grpo,tandem_k0,tandem_k1 --seeds 0,1,2 --out bench/results/learning_cpu_raw
  python bench/learning.py table bench/results/learning_cpu_raw        # the table, and reward.png there
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

CANDIDATES = ("trl_grpo", "tandem_k0", "tandem_k1")
LABELS = {"trl_grpo": "TRL GRPOTrainer", "tandem_k0": "Tandem max_staleness 0", "tandem_k1": "Tandem max_staleness 1"}
EVAL_N = 64  # completions per eval prompt: 384 per evaluation, a standard error of about 0.01 on the reward
TARGET = 0.9  # time to target: the wall time at which a candidate first reaches 90% of TRL's final eval reward


def prepare(work: Path) -> Path:
    """The demo's model, prompts and eval set under work/sevens (built once)."""
    from examples.sevens.prepare import main as build

    build(str(work / "sevens"))
    return work / "sevens"


def tandem_job(data: Path, out: Path, k: int, seed: int, steps: int, eval_every: int):
    from tandem.core.config import JobConfig

    d = JobConfig.from_yaml(ROOT / "examples" / "sevens.yaml").model_dump(mode="json", exclude_unset=True)
    d["model"]["path"] = str(data / "model")
    d["data"]["path"] = str(data / "prompts.jsonl")
    d["batch"]["max_steps"] = steps
    d["cluster"]["max_staleness"] = k
    d["eval"].update(path=str(data / "eval.jsonl"), eval_steps=eval_every, num_generations=EVAL_N)
    d["logging"] = {"output_dir": str(out), "progress": False}
    d["seed"] = seed
    return JobConfig.from_dict(d)


def run_tandem(data: Path, out: Path, k: int, seed: int, steps: int, eval_every: int) -> list[dict]:
    """Tandem as its users run it (tandem run: embedded Ray, vLLM, DeepSpeed) -> the eval curve."""
    from tandem.services.app.run import run_job

    launched = time.time()
    rc = run_job(tandem_job(data, out, k, seed, steps, eval_every), out=open(os.devnull, "w"))
    if rc != 0:
        raise SystemExit(f"tandem run ended with {rc}")
    return eval_curve(out / "metrics.jsonl", launched)


def eval_curve(metrics: Path, launched: float) -> list[dict]:
    """A Tandem run's evaluations from its metrics.jsonl: step, wall time since `launched` less the evaluations'
    own, eval reward."""
    curve, evals_s = [], 0.0
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "eval/reward" in r:
            curve.append({"step": r["step"], "wall_s": r["time"] - launched - evals_s, "reward": r["eval/reward"]})
            evals_s += r.get("eval_s", 0.0)
    return curve


def sample_reward(model, tok, prompts: list[str], n: int, seed: int) -> float:
    """The mean sevens reward of n completions per prompt sampled from `model` at temperature 1 (full softmax)."""
    import torch

    from examples.rewards import sevens_reward

    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    total = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids.repeat(n, 1), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=8, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        total += sevens_reward(texts)
    model.train(was_training)
    return statistics.mean(total)


def run_trl(data: Path, out: Path, seed: int, steps: int, eval_every: int) -> list[dict]:
    """TRL's GRPOTrainer as its users run it on a CPU (transformers generate), the demo's settings -> the eval curve."""
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29700 + os.getpid() % 1000)})
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from examples.rewards import sevens_reward
    from tandem.core.config import JobConfig

    launched = time.time()
    job = JobConfig.from_yaml(ROOT / "examples" / "sevens.yaml")
    prompts = [json.loads(x)["prompt"][0]["content"] for x in (data / "eval.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (data / "prompts.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(data / "model")
    conf = GRPOConfig(output_dir=str(out), per_device_train_batch_size=job.batch.per_device_train_batch_size,
                      gradient_accumulation_steps=1, num_generations=job.batch.num_generations,
                      max_completion_length=job.generation.max_completion_length, max_steps=steps,
                      learning_rate=job.optimizer.learning_rate, lr_scheduler_type="constant", temperature=1.0,
                      beta=0.0, loss_type="dapo", logging_steps=1, report_to="none", save_strategy="no", seed=seed,
                      use_cpu=True, bf16=False)
    lora = job.model.lora
    peft = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, target_modules=lora.target_modules, task_type="CAUSAL_LM")
    curve, evals_s = [], [0.0]

    def evaluate(model, step: int) -> None:
        t = time.time()
        curve.append({"step": step, "wall_s": t - launched - evals_s[0],
                      "reward": sample_reward(model, tok, prompts, EVAL_N, seed * 1000 + step)})
        evals_s[0] += time.time() - t

    class Eval(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **k):
            evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **k):
            if state.global_step % eval_every == 0 or state.global_step == steps:
                evaluate(model, state.global_step)

    tr = GRPOTrainer(model=str(data / "model"), reward_funcs=sevens_reward, args=conf,
                     train_dataset=Dataset.from_list(rows), peft_config=peft, processing_class=tok,
                     callbacks=[Eval()])
    tr.train()
    return curve


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "vllm", "ray", "deepspeed", "trl", "transformers", "peft")
            if _installed(p)}


def _installed(p: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(p)
        return True
    except md.PackageNotFoundError:
        return False


def run(a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare(Path(a.work))
    for seed in map(int, a.seeds.split(",")):
        for c in a.candidates.split(","):
            dest = out / f"{c}-seed{seed}.json"
            run_dir = Path(a.work) / f"{c}-seed{seed}"
            t0 = time.time()
            curve = (run_trl(data, run_dir, seed, a.steps, a.eval_every) if c == "trl_grpo" else
                     run_tandem(data, run_dir, int(c.removeprefix("tandem_k")), seed, a.steps, a.eval_every))
            dest.write_text(json.dumps({"candidate": c, "seed": seed, "steps": a.steps, "curve": curve,
                                        "run_s": time.time() - t0, "versions": versions(),
                                        "machine": f"{platform.processor() or platform.machine()}, "
                                                   f"{os.cpu_count()} cores"}, indent=1))
            print(f"{c} seed {seed}: eval reward {curve[0]['reward']:.3f} -> {curve[-1]['reward']:.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)


def time_to(curve: list[dict], target: float) -> float | None:
    """The wall time of the first evaluation at or above target (None: never)."""
    return next((p["wall_s"] for p in curve if p["reward"] >= target), None)


def summary(runs: dict[str, list[dict]]) -> tuple[dict, float]:
    """Per candidate: final eval reward mean and spread over seeds, time to target per seed -> (rows, target)."""
    final = lambda c: [r["curve"][-1]["reward"] for r in runs[c]]  # noqa: E731
    target = TARGET * statistics.mean(final("trl_grpo")) if "trl_grpo" in runs else None
    rows = {}
    for c, rs in runs.items():
        f = final(c)
        times = [time_to(r["curve"], target) for r in rs] if target is not None else []
        rows[c] = {"seeds": len(rs), "start": statistics.mean(r["curve"][0]["reward"] for r in rs),
                   "final_mean": statistics.mean(f), "final_sd": statistics.stdev(f) if len(f) > 1 else 0.0,
                   "final_min": min(f), "final_max": max(f), "time_to_target_s": times,
                   # start-up: launch to the first evaluation (Ray, the engines, the model); the rate after it
                   "startup_s": statistics.mean(r["curve"][0]["wall_s"] for r in rs),
                   "steps_per_s": statistics.mean((r["curve"][-1]["step"] - r["curve"][0]["step"]) /
                                                  (r["curve"][-1]["wall_s"] - r["curve"][0]["wall_s"]) for r in rs)}
    return rows, target


def table(folder: Path) -> str:
    runs: dict[str, list[dict]] = {}
    for f in sorted(folder.glob("*-seed*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["candidate"], []).append(r)
    rows, target = summary(runs)
    base = rows.get("trl_grpo")
    fmt_t = lambda ts: ", ".join("never" if t is None else f"{t:.0f}" for t in ts)  # noqa: E731
    lines = [f"Target: {TARGET:.0%} of TRL GRPOTrainer's final eval reward = {target:.3f}" if target else "",
             "", "| candidate | seeds | eval reward at step 0 | final eval reward, mean ± sd (min-max) | "
             "× TRL's final | time to target from launch, s (each seed) | start-up, s | steps/s after it |",
             "|" + " --- |" * 8]
    for c, r in rows.items():
        ratio = f"{r['final_mean'] / base['final_mean']:.2f}" if base else "—"
        lines.append(f"| {LABELS.get(c, c)} | {r['seeds']} | {r['start']:.3f} | {r['final_mean']:.3f} ± "
                     f"{r['final_sd']:.3f} ({r['final_min']:.3f}-{r['final_max']:.3f}) | {ratio} | "
                     f"{fmt_t(r['time_to_target_s'])} | {r['startup_s']:.1f} | {r['steps_per_s']:.2f} |")
    plot(runs, folder / "reward.png", target)
    (folder / "summary.json").write_text(json.dumps({"target": target, "candidates": rows}, indent=1))
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: Path, target: float | None) -> None:
    """Eval reward against wall-clock and against step: each candidate's mean over seeds, its min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c, rs in runs.items():
        steps = [p["step"] for p in rs[0]["curve"]]
        rew = np.array([[p["reward"] for p in r["curve"]] for r in rs])
        wall = np.array([[p["wall_s"] for p in r["curve"]] for r in rs]).mean(0)
        for ax, x in zip(axes, (wall, steps)):
            ax.plot(x, rew.mean(0), marker="o", ms=3, label=LABELS.get(c, c))
            ax.fill_between(x, rew.min(0), rew.max(0), alpha=0.2)
    for ax, name in zip(axes, ("wall-clock, s (launch to evaluation, evaluations left out)", "optimizer step")):
        ax.set_xlabel(name)
        ax.set_ylabel("eval reward (384 completions)")
        if target:
            ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("sevens task on this CPU: mean over seeds, band min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("run", "table"))
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--work", default="/tmp/tandem-learning")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_cpu_raw"))
    a = ap.parse_args()
    if a.cmd == "table":
        print(table(Path(a.folder or a.out)))
    else:
        run(a)


if __name__ == "__main__":
    main()
