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
from typing import Any

import numpy as np

from tandem.core.loader import load_function


class RewardError(RuntimeError):
    pass


class RewardFunctions:
    def __init__(self, specs: list[str]):
        self.specs = list(specs)
        self.fns = [load_function(s) for s in specs]

    def __len__(self) -> int:
        return len(self.fns)

    def score(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
              columns: dict[str, list[Any]], rows: list[int]) -> np.ndarray:
        """-> float32 [N, F]; rows[i] is the dataset row of sample i (for error messages)."""
        n = len(completions)
        out = np.full((n, len(self.fns)), np.nan, dtype=np.float32)
        for f, (spec, fn) in enumerate(zip(self.specs, self.fns)):
            where = f"reward function {spec!r} on dataset row(s) {sorted(set(rows))}"
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
                raise RewardError(f"{where}: must return a list of {n} floats or None, got {got}")
            for i, v in enumerate(values):
                if v is None:
                    continue
                if not isinstance(v, (int, float, np.integer, np.floating, np.bool_)):  # bool counts as 0/1
                    raise RewardError(f"reward function {spec!r} on dataset row {rows[i]}: "
                                      f"sample {i} is {v!r} ({type(v).__name__}); expected a number or None")
                if not math.isfinite(float(v)):
                    raise RewardError(f"reward function {spec!r} on dataset row {rows[i]}: sample {i} is {v}; "
                                      "rewards must be finite (return None to skip a sample)")
                out[i, f] = float(v)
        return out
