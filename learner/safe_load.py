"""Checkpoint files are read without unpickling: DeepSpeed's loader calls torch.load(weights_only=False),
which runs whatever a planted pickle says. Here every DeepSpeed state file goes through
torch.load(weights_only=True), with only DeepSpeed's own plain state classes allowed."""

from __future__ import annotations

import pickle

import torch

from tandem.core.errors import TandemError


class CheckpointRefused(TandemError, RuntimeError):
    """A checkpoint file holds something loading it would have to run."""


class CheckpointWriteError(TandemError, RuntimeError):
    """A checkpoint could not be written (a full disk): its temporary directory is gone, older ones stay."""


def deepspeed_state_classes() -> list:
    """The plain classes DeepSpeed writes into its optimizer files (found by loading them with
    weights_only=True at ZeRO 0/2/3, fp32 and bf16): a loss scaler, the ZeRO stage, fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_without_pickle(path: str, map_location=None):
    """torch.load that runs no code from the file; -> its contents, or CheckpointRefused naming it."""
    try:
        with torch.serialization.safe_globals(deepspeed_state_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((x.strip() for x in str(e).splitlines() if "Unsupported" in x or "GLOBAL" in x),
                   str(e).splitlines()[0] if str(e) else "not a tensor file")
        raise CheckpointRefused(f"checkpoint file {path}: refused, loading it would run code it holds ({why[:200]}); "
                                "allowed: tensors, plain containers and DeepSpeed's own state classes") from None


def refuse_pickles(engine) -> None:
    """Every file DeepSpeed's engine loads from now on goes through load_without_pickle."""
    engine.checkpoint_engine.load = load_without_pickle
