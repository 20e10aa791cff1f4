"""Tandem: distributed GRPO training. `from tandem import GRPOTrainer, GRPOConfig` is TRL's front door
(tandem.services.app.trainer); imported on first use, so `import tandem` stays light."""

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name in __all__:
        from tandem.services.app import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
