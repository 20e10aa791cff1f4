"""Tandem: distributed GRPO training. `from tandem import GRPOTrainer, GRPOConfig` is TRL's front door
(tandem.services.app.trainer), imported on first use, so `import tandem` stays light; the errors a run raises
(`TandemError` and its subclasses, tandem/core/errors.py) import nothing heavy."""

from tandem.core.errors import (
    JobConfigError,
    LearnerLost,
    RewardContractError,
    RewardError,
    TandemError,
    ToolError,
    TrainingError,
)

__all__ = ["GRPOConfig", "GRPOTrainer", "JobConfigError", "LearnerLost", "RewardContractError", "RewardError", "TandemError",
           "ToolError", "TrainingError"]


def __getattr__(name: str):
    if name in ("GRPOConfig", "GRPOTrainer"):
        from tandem.services.app import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
