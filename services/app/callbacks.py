"""transformers' TrainerCallback hooks around a Tandem run, called in the driver's process at the points TRL's Trainer
calls them: on_train_begin; per optimizer step on_step_end then on_log with the step's row (TRL's names); on_evaluate
and on_log with an evaluation's row; on_save when a `checkpoint-N/` is complete; on_train_end. A callback that sets
`control.should_training_stop` ends the run after the cycle in progress, with the final checkpoint, as in TRL.

The rows come from the run's metrics.jsonl as the controller writes it, after each generation cycle (a cycle may
hold several optimizer steps: their hooks are called one after the other)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tandem.core.errors import TrainingError
from tandem.services.orchestrator.run_log import parse_lines, read_lines
from tandem.services.orchestrator.trl_checkpoint import Epochs, log_rows, reward_names, trl_checkpoints


class Callbacks:
    """The trainer's callbacks (instances, or classes made with no arguments, as transformers takes them)."""

    def __init__(self, callbacks: list | None = None):
        self.items: list = []
        for cb in callbacks or []:
            self.add(cb)

    def add(self, cb: Any) -> None:
        if not any(name.startswith("on_") for name in dir(cb)):
            from tandem.core.config import JobConfigError

            raise JobConfigError(f"callbacks=[{getattr(cb, '__name__', type(cb).__name__)}]: not a transformers "
                                 "TrainerCallback (no on_* hook); allowed: TrainerCallback subclasses or instances")
        self.items.append(cb() if isinstance(cb, type) else cb)

    def pop(self, cb: Any) -> Any:
        found = self._find(cb)
        if found is not None:
            self.items.remove(found)
        return found

    def _find(self, cb: Any) -> Any:
        return next((x for x in self.items if x is cb or (isinstance(cb, type) and isinstance(x, cb))), None)

    def fire(self, event: str, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        """Each callback's `event` hook; a hook that returns a TrainerControl replaces it, as transformers'
        CallbackHandler does. -> the control."""
        for cb in self.items:
            try:
                out = getattr(cb, event, lambda *a, **k: None)(args, state, control, **kw)
            except Exception as e:  # the user's code: named, its own error kept as the cause
                raise TrainingError(f"callbacks: {type(cb).__name__}.{event} raised {type(e).__name__}: "
                                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}".rstrip(": ")) from e
            if out is not None:
                control = out
        return control


class RunEvents:
    """One train() call's hooks: reads the metrics lines and checkpoint-N directories that are new since the last
    cycle and calls the callbacks for them, keeping `state` (transformers' TrainerState) current."""

    def __init__(self, callbacks: Callbacks, args: Any, state: Any, cfg, epochs: Epochs | None):
        from transformers import TrainerControl

        self.callbacks, self.args, self.state, self.cfg, self.epochs = callbacks, args, state, cfg, epochs
        self.control = TrainerControl()
        self.metrics = Path(cfg.run_dir) / "metrics.jsonl"
        self.offset = self._size()  # what an earlier run (a resumed one) logged is history already
        self.last_step = max((x.get("step", 0) for x in read_lines(self.metrics)), default=0)
        self.saved = {n for n, _ in trl_checkpoints(cfg.logging.output_dir)}
        self.rewards = reward_names(cfg.rewards)

    def _size(self) -> int:
        return self.metrics.stat().st_size if self.metrics.is_file() else 0

    def _new_lines(self) -> list[dict]:
        """The whole lines written since the last call (read from where that one stopped, not the file again). A
        file grown shorter (a restart cut the lines after its checkpoint) is read again from its start, the steps
        already reported skipped."""
        if self._size() < self.offset:
            self.offset = 0
        with open(self.metrics, "rb") if self.metrics.is_file() else open(os.devnull, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(whole)
        return [x for x in parse_lines(whole.decode()) if x.get("step", 0) > self.last_step
                or (x.get("step", 0) == self.last_step == 0 and "loss" not in x)]  # or the evaluation at step 0

    def _fire(self, event: str, **kw: Any) -> None:
        self.control = self.callbacks.fire(event, self.args, self.state, self.control, **kw)

    def begin(self) -> None:
        self._fire("on_train_begin")

    def after_cycle(self, _result: dict | None = None) -> bool:
        """The hooks for what the cycle logged and saved. -> a callback asked to stop."""
        for line in self._new_lines():
            self.last_step = max(self.last_step, int(line.get("step", 0)))
            for row in log_rows(line, self.rewards, self.epochs):
                self.state.log_history.append(row)
                if any(k.startswith("eval_") for k in row):
                    self._fire("on_evaluate", metrics=row)
                else:
                    self.state.global_step, self.state.epoch = row["step"], row.get("epoch")
                    self._fire("on_step_end")
                self._fire("on_log", logs=row)
        for step, _ in trl_checkpoints(self.cfg.logging.output_dir):
            if step not in self.saved:
                self.saved.add(step)
                self._fire("on_save")
        return bool(self.control.should_training_stop)

    def end(self, summary: dict) -> None:
        """The final evaluation and checkpoint's hooks, then the run's summary row (TRL's train_runtime, train_loss,
        ...) logged, then on_train_end."""
        self.after_cycle()
        self.state.log_history.append(summary)
        self._fire("on_log", logs=summary)
        self._fire("on_train_end")
