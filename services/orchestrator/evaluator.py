"""Evaluation during training (the `eval` section): the eval prompts, split over the rollout workers that
serve the newest adapter, sampled with the eval settings and scored by the job's reward functions.
Its groups never reach the group buffer or the learner, so training's staleness accounting is
untouched. Knows nothing of the controller: it is handed the workers and the version they serve.

Each evaluation writes its completions to <output_dir>/eval/step-NNNNNN.jsonl and returns its metrics
(eval/reward, eval/reward_std, eval/completion_length, eval/rewards/<i>/mean, ...), which the
controller adds to that step's metrics line."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tandem.core.protocol import RolloutGroup
from tandem.core.shaping import total_rewards
from tandem.rollout.engines.base import Sampling


def eval_stats(rewards: np.ndarray, lengths: np.ndarray, eos: np.ndarray, weights) -> dict:
    """Metrics of the eval completions: rewards [N, F] (NaN = the function returned None), lengths [N],
    eos [N]. The reward of a completion is the weighted sum of its functions' (None counts 0), as in
    training; completions no function scored are left out of eval/reward."""
    r = np.asarray(rewards, dtype=np.float64)
    total, valid = total_rewards(r, weights)
    total = total[valid]
    out = {
        "eval/reward": float(total.mean()) if len(total) else 0.0,
        "eval/reward_std": float(total.std(ddof=1)) if len(total) > 1 else 0.0,
        "eval/completion_length": float(np.mean(lengths)) if len(lengths) else 0.0,
        "eval/frac_truncated": float(1 - np.mean(eos)) if len(eos) else 0.0,
        "eval/completions": int(len(lengths)),
    }
    for f in range(r.shape[1]):
        col = r[:, f][~np.isnan(r[:, f])]
        out[f"eval/rewards/{f}/mean"] = float(col.mean()) if len(col) else 0.0
    return out


class Evaluator:
    def __init__(self, cfg, table, tokenizer):
        """table: the eval prompts (services.prompt_source.PromptTable)."""
        e = cfg.eval
        self.cfg, self.table, self.tok = cfg, table, tokenizer
        self.every = e.eval_steps
        train = Sampling.from_config(cfg, seed=cfg.seed)  # the job's sampling, seeded: evaluations compare
        self.sampling = replace(train, n=e.num_generations,
                                temperature=train.temperature if e.temperature is None else e.temperature)
        self.dir = Path(cfg.run_dir) / "eval"
        self.postponed: int | None = None  # the step of an evaluation no worker could run: it runs at the next cycle

    def due(self, first_step: int, last_step: int, final: bool) -> bool:
        """After a cycle that trained steps first_step..last_step: every eval_steps, one postponed, and at the end."""
        if final or self.postponed is not None:
            return True
        return self.every > 0 and last_step // self.every > (first_step - 1) // self.every

    def at(self, pool, serving, version: int, step: int, last: bool, say) -> dict:
        """The evaluation due at `step` on the pool's workers serving now. With none serving (the only rollout node
        lost, its worker's replacement starting) it is postponed to the next cycle, said in one line; the run's
        `last` one waits for a worker instead (serving(): the workers serving, once there is one; the pool says the
        wait every 10 s), so the final evaluation always runs."""
        if not pool.serving() and not last:
            if self.postponed is None:
                self.postponed = step
                say(f"tandem: the evaluation of step {step} is postponed: no rollout worker serves now (worker(s) "
                    f"{pool.starting(0)} starting); it runs at the next cycle that has one")
            return {}
        out = self.run(pool.ray, serving(), version, step)
        if self.postponed is not None and self.postponed != step:
            out["eval/postponed_from"] = self.postponed
        self.postponed = None
        return out

    def run(self, ray, workers: list, version: int, step: int) -> dict:
        t0 = time.time()
        items = [self.table.item(i, 0) for i in range(len(self.table))]
        if not workers:
            raise RuntimeError("Evaluator.run: no rollout worker serves; cannot evaluate")
        chunks = [items[i::len(workers)] for i in range(len(workers))]
        refs = [(w, c, w.generate.remote(c, self.sampling)) for w, c in zip(workers, chunks) if c]
        groups, failed = [], []
        for w, chunk, ref in refs:
            try:
                groups += list(zip(chunk, ray.get(ref)))
            except ray.exceptions.RayError as e:  # a worker died: the others' results still count
                failed.append(f"worker {workers.index(w)}: {type(e).__name__}")
        scored = [(it, g) for it, g in groups if isinstance(g, RolloutGroup)]
        errors = [g.message for _, g in groups if not isinstance(g, RolloutGroup)]
        F = len(self.cfg.rewards) + (self.cfg.environment is not None)
        rewards = np.concatenate([g.rewards for _, g in scored]) if scored else np.zeros((0, F))
        lengths = np.concatenate([g.lengths for _, g in scored]) if scored else np.zeros(0)
        eos = np.concatenate([g.eos for _, g in scored]) if scored else np.zeros(0, dtype=bool)
        out = eval_stats(rewards, lengths, eos, self.cfg.column_weights())
        out.update({"eval/prompts": len(scored), "eval/prompts_failed": len(items) - len(scored),
                    "eval/version": version, "eval_s": time.time() - t0})
        self._write(step, scored, version)
        if failed or errors:
            print(f"tandem: eval at step {step}: {len(items) - len(scored)} of {len(items)} prompts not scored "
                  f"({'; '.join((failed + errors)[:3])})", flush=True)
        return out

    def _write(self, step: int, scored, version: int) -> None:
        """The completions of one evaluation, one line each: what a user reads to see what the model says."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"step-{step:06d}.jsonl.tmp"
        with open(tmp, "w") as f:
            for it, g in scored:
                for c in range(g.num_generations):
                    r = g.rewards[c]
                    f.write(json.dumps({
                        "step": step, "index": it.index, "version": version, "prompt": it.prompt,
                        "completion": self.tok.decode(g.completion(c), skip_special_tokens=True),
                        "rewards": [None if np.isnan(x) else float(x) for x in r],
                        "length": int(g.lengths[c]), "eos": bool(g.eos[c]),
                    }) + "\n")
        tmp.replace(self.dir / f"step-{step:06d}.jsonl")
