"""The errors a job stops with, one class per kind of cause: what `tandem run` prints as one line and what
`GRPOTrainer.train()` raises, whichever actor raised it. Each still subclasses the builtin a caller may already
catch (ValueError for a bad job, RuntimeError for a failing function, OSError for storage)."""

from __future__ import annotations


class TandemError(Exception):
    """A job that stopped, or could not start, for a reason its message names in one line."""


class JobConfigError(TandemError, ValueError):
    """A job file, override or trainer argument that cannot be run; the message names field, value and what is
    allowed."""


class RewardError(TandemError, RuntimeError):
    """A reward function that raised, hung, died, or returned what is not a reward (the message names it and the
    dataset row)."""


class RewardContractError(RewardError):
    """A reward function whose answer has the wrong shape or type (not a list of one number or None per completion):
    a mistake in the function, the same on every row, so the job stops at the first one instead of failing each
    prompt in turn."""


class ToolError(TandemError, RuntimeError):
    """A tool or environment that cannot be run as the job declares it."""


class TrainingError(TandemError, RuntimeError):
    """The job failed while training: a learner or worker error, too many failed prompts, the restarts spent."""


class LearnerLost(TrainingError):
    """A learner rank's actor died or cannot be reached (its process or its node lost): the message names the rank,
    its node (host, address, Ray node id) and the cause in a few words. The job restarts from its newest
    checkpoint (cluster.max_restarts)."""
