"""Prompts that did not become a trainable group, recorded in <output_dir>/failed_prompts.jsonl: a reward
function that failed twice (the prompt source retries it once), and groups without any reward (every function
returned None for every completion: TRL warns and trains on zeros; here they are recorded, not trained on).
Too many failures stop the run, as does a whole cycle of groups without reward."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.core.config import JobConfigError


class FailureLog:
    TRANSIENT = ("no_reward_run",)  # a run of groups counts within one process

    def __init__(self, path: Path, rewards: list[str], unique_prompts: int, rows: int):
        self.path, self.rewards, self.unique_prompts, self.rows = path, rewards, unique_prompts, rows
        self.failed: list[dict] = []  # {index, epoch, reason, message}
        self.no_reward_run = 0  # groups without reward in a row (a rewarded one resets it)

    def rewarded(self) -> None:
        self.no_reward_run = 0

    def no_reward(self, index: int, epoch: int, message: str) -> None:
        self._record(index, epoch, "no_reward", message)
        self.no_reward_run += 1
        if self.no_reward_run >= self.unique_prompts:
            raise JobConfigError(
                f"rewards = {self.rewards}: returned None for every completion of the last {self.no_reward_run} "
                f"prompts, a whole generation cycle: nothing to train on (each recorded in {self.path}); allowed: "
                "reward functions that return a number for at least some completions (None skips a sample)")

    def reward_error(self, index: int, epoch: int, message: str) -> None:
        """A prompt out of retries: recorded; more than a quarter of the rows (at least 4) stops the run."""
        self._permanent(index, epoch, "reward_error", message)

    def worker_died(self, index: int, epoch: int, message: str) -> None:
        """A prompt whose rollout worker died twice while running it (the second time alone): as reward_error."""
        self._permanent(index, epoch, "worker_died", message)

    def _permanent(self, index: int, epoch: int, reason: str, message: str) -> None:
        self._record(index, epoch, reason, message)
        if sum(f.get("reason") != "no_reward" for f in self.failed) > max(4, self.rows // 4):
            raise RuntimeError(f"{len(self.failed)} prompts failed permanently; last: {message}")

    def _record(self, index: int, epoch: int, reason: str, message: str) -> None:
        self.failed.append({"index": index, "epoch": epoch, "reason": reason, "message": message})
        with open(self.path, "a") as f:
            f.write(json.dumps(self.failed[-1]) + "\n")

    def state(self) -> dict:
        return {"failed": list(self.failed)}

    def load(self, st: dict) -> None:
        self.failed = list(st["failed"])
