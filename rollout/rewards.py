"""Reward functions with TRL's calling convention:

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]

None becomes NaN (the function does not apply to that sample). A function that raises, returns
the wrong length, a non-number or a non-finite number is a RewardError naming the function
and the dataset row: never a silent zero.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from tandem.core.errors import RewardContractError, RewardError
from tandem.core.loader import load_function, shown_name
from tandem.rollout.child_pool import ChildPool


class RewardFunctions:
    def __init__(self, specs: list[str]):
        self.specs = list(specs)
        self.fns = [load_function(s) for s in specs]

    def __len__(self) -> int:
        return len(self.fns)

    def start(self) -> None:
        """Nothing to start in-process (IsolatedRewards spawns its processes)."""

    def close(self) -> None:
        """Nothing to release in-process (IsolatedRewards stops its processes)."""

    def score(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
              columns: dict[str, list[Any]], rows: list[int]) -> np.ndarray:
        """-> float32 [N, F]; rows[i] is the dataset row of sample i (for error messages)."""
        n = len(completions)
        out = np.full((n, len(self.fns)), np.nan, dtype=np.float32)
        for f, (spec, fn) in enumerate(zip(self.specs, self.fns)):
            where = f"reward function {shown_name(spec)!r} on dataset row(s) {sorted(set(rows))}"
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
                if inspect.isawaitable(values):
                    values = asyncio.run(values)
            except Exception as e:
                raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
            if isinstance(values, np.ndarray):
                values = values.tolist()
            if not isinstance(values, (list, tuple)) or len(values) != n:
                got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
                raise RewardContractError(f"{where}: must return a list of {n} floats or None, got {got}")
            for i, v in enumerate(values):
                out[i, f] = reward_value(v, f"reward function {shown_name(spec)!r} on dataset row {rows[i]}: sample {i}")
        return out


def reward_value(v, where: str) -> float:
    """One reward as the loss takes it: a finite number (a bool counts as 0/1), None = NaN (no reward for that
    sample); anything else a RewardError saying `where` ("reward function 'f' on dataset row 3: sample 1")."""
    if v is None:
        return math.nan
    if not isinstance(v, (int, float, np.integer, np.floating, np.bool_)):
        raise RewardContractError(f"{where} is {v!r} ({type(v).__name__}); expected a number or None")
    if not math.isfinite(float(v)):
        raise RewardError(f"{where} is {v}; rewards must be finite (return None to skip a sample)")
    return float(v)


_CHILD: RewardFunctions | None = None


def _child_init(specs: list[str]) -> None:
    global _CHILD
    _CHILD = RewardFunctions(specs)


def _child_score(kw: dict) -> np.ndarray:
    return _CHILD.score(**kw)


class IsolatedRewards:
    """RewardFunctions in child processes, with a time limit per call: a reward that hangs or kills its process
    (os._exit, a crash) fails its own group as a RewardError and the pool restarts; the rollout worker and its
    engine never stop."""

    def __init__(self, specs: list[str], timeout_s: float, processes: int = 1):
        self.specs, self.timeout = list(specs), timeout_s
        self.pool = ChildPool(processes, _child_init, (self.specs,))

    def __len__(self) -> int:
        return len(self.specs)

    def start(self) -> None:
        self.pool.start()

    def score(self, *, rows: list[int], **kw) -> np.ndarray:
        where = f"reward functions {[shown_name(s) for s in self.specs]} on dataset row(s) {sorted(set(rows))}"
        for attempt in range(2):
            pool, gen = self.pool.current()
            try:
                return pool.submit(_child_score, dict(kw, rows=rows)).result(timeout=self.timeout)
            except FutureTimeout:
                self.pool.restart(gen)
                raise RewardError(f"{where}: no result within {self.timeout:g} s (reward_timeout_s); "
                                  "its process was stopped") from None
            except BrokenProcessPool:
                by_other = self.pool.generation != gen
                self.pool.restart(gen)
                if by_other and attempt == 0:
                    continue  # another call's reward broke the pool: this one gets a fresh try
                raise RewardError(f"{where}: the process scoring it died (os._exit, a signal or a crash)") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.pool.close()
