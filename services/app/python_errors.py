"""A failed job as the Python error a script can catch: `GRPOTrainer.train()` raises one `tandem.TandemError`
subclass whose message is the line `tandem run` prints, with what the actor printed (its traceback, colour codes
removed) attached as the cause, instead of Ray's wrapper of it."""

from __future__ import annotations

import re
import traceback

from tandem.core.errors import TandemError, TrainingError

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")

# a job file's words -> what a Python caller writes for the same thing
PYTHON_WORDS = (
    ("checkpoint.resume: true", "train(resume_from_checkpoint=True)"),
    ("logging.overwrite_output_dir: true", "GRPOConfig(overwrite_output_dir=True)"),
    ("logging.output_dir", "GRPOConfig.output_dir"),
)


class ActorTraceback(Exception):
    """What the process that raised the error printed: its traceback, as text (the cause of a TandemError)."""


def in_python_words(message: str) -> str:
    for job_words, python in PYTHON_WORDS:
        message = message.replace(job_words, python)
    return message


def as_python_error(e: BaseException) -> TandemError:
    """The TandemError to raise for `e` (a RayTaskError, an actor's death, a local error): the root cause's class
    where it is one (TrainingError otherwise) and its one line; `__cause__` set to the traceback's text."""
    from tandem.services.app.run import one_line, root_cause

    root = root_cause(e)
    message = in_python_words(one_line(e))
    cls = type(root) if isinstance(root, TandemError) else TrainingError
    try:
        err = cls(message)
    except TypeError:  # a subclass whose constructor takes other arguments
        err = TrainingError(message)
    remote = getattr(e, "traceback_str", None)  # a RayTaskError's whole traceback (its str leaves frames out)
    text = remote if isinstance(remote, str) else str(e) if str(e).count("\n") > 1 else "".join(
        traceback.format_exception(e))
    err.__cause__ = ActorTraceback(_COLOUR.sub("", text).strip())
    err.__suppress_context__ = True
    return err
