"""Prompts that did not become a trainable group, recorded in <output_dir>/failed_prompts.jsonl: a reward
function that failed twice (the prompt source retries it once), a prompt whose worker died twice, one whose group
went twice past max_staleness in an epoch (not trained that epoch, sampled afresh in the next), and groups
without any reward (every function returned None for every completion: TRL warns and trains on zeros; here they
are recorded, not trained on). Too many failures stop the run, as does a whole cycle of groups without reward."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from tandem.core.config import JobConfigError
from tandem.core.errors import RewardError, TrainingError


class FailureLog:
    # within one process: a run of groups, the terminal's lines
    TRANSIENT = ("no_reward_run", "say", "_said", "_unsaid")

    SAY_EVERY_S, SAY_BURST = 10.0, 3  # at most 3 lines on the terminal per 10 s; the file has every one

    def __init__(self, path: Path, rewards: list[str], unique_prompts: int, rows: int,
                 say: Callable[[str], None] = lambda line: None):
        self.path, self.rewards, self.unique_prompts, self.rows = path, rewards, unique_prompts, rows
        self.failed: list[dict] = []  # {index, epoch, reason, message}
        self.no_reward_run = 0  # groups without reward in a row (a rewarded one resets it)
        self.say, self._said, self._unsaid = say, [], 0  # times of the lines said lately; failures not said

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

    def never_trained(self) -> int:
        """Prompts recorded here so far (each not trained in its epoch)."""
        return len(self.failed)

    def reward_error(self, index: int, epoch: int, message: str) -> None:
        """A prompt out of retries: recorded; more than a quarter of the rows (at least 4) stops the run."""
        self._permanent(index, epoch, "reward_error", message)

    def worker_died(self, index: int, epoch: int, message: str) -> None:
        """A prompt whose rollout worker died twice while running it (the second time alone): as reward_error."""
        self._permanent(index, epoch, "worker_died", message)

    def too_slow(self, index: int, epoch: int, lag: int, max_staleness: int, oversample: int = 0) -> None:
        """A prompt whose group went past the bound a second time in its epoch (stopped mid-sampling, or back too
        late): recorded as not trained this epoch (TRL's AsyncGRPOTrainer drops such samples and logs it at info level).
        More than a quarter of one epoch's rows (at least 4) stops the run: the bound leaves most of the data
        untrained. oversample: the prompts over-sampled (cluster.rollout_oversample_prompts), whose groups not taken
        in time are stopped the same way: the refusal names them too."""
        self._record(index, epoch, "stale", f"its group went past the staleness bound a second time, {lag} policy "
                     f"versions behind (cluster.max_staleness = {max_staleness}): it takes longer to sample and score "
                     f"than {max_staleness + 1} cycles; sampled afresh in epoch {epoch + 1}; allowed: a larger "
                     "cluster.max_staleness, or a smaller generation.max_completion_length")
        # by row: after a resume the source counts a row's stale groups anew, and may record it again
        n = len({f["index"] for f in self.failed if f["reason"] == "stale" and f["epoch"] == epoch})
        if n > max(4, self.rows // 4):
            fewer = (f", or fewer cluster.rollout_oversample_prompts ({oversample} here: each cycle the groups a "
                     "batch had no room for are stopped as the bound's)") if oversample else ""
            raise TrainingError(f"{n} prompts of epoch {epoch} went twice past cluster.max_staleness = "
                                f"{max_staleness} (each in {self.path}): at this bound most of the data is never "
                                "trained on; allowed: a larger cluster.max_staleness, or a smaller "
                                f"generation.max_completion_length{fewer}")

    def _permanent(self, index: int, epoch: int, reason: str, message: str) -> None:
        self._record(index, epoch, reason, message)
        if sum(f.get("reason") not in ("no_reward", "stale") for f in self.failed) > max(4, self.rows // 4):
            error = RewardError if reason == "reward_error" else TrainingError
            raise error(f"{len(self.failed)} prompts failed permanently (each in {self.path}); last: {message}")

    def _record(self, index: int, epoch: int, reason: str, message: str) -> None:
        self.failed.append({"index": index, "epoch": epoch, "reason": reason, "message": message})
        with open(self.path, "a") as f:
            f.write(json.dumps(self.failed[-1]) + "\n")
        self._tell(f"tandem: dataset row {index} (epoch {epoch}) not trained on, {reason}: {message[:300]}")

    def _tell(self, line: str) -> None:
        now = time.time()
        self._said = [t for t in self._said if now - t < self.SAY_EVERY_S]
        if len(self._said) >= self.SAY_BURST:
            self._unsaid += 1
            return
        more = f" (and {self._unsaid} more before it, in {self.path})" if self._unsaid else ""
        self._said.append(now)
        self._unsaid = 0
        self.say(line + more)

    def state(self) -> dict:
        return {"failed": list(self.failed)}

    def load(self, st: dict) -> None:
        self.failed = list(st["failed"])
