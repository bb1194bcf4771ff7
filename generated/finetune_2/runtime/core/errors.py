"""What a pipeline's run reports: its error, messages in one line, and the words of the
run-time checks generated code makes.

Copied into every generated pipeline as ``runtime/core/errors.py``; it needs only the standard
library. The compiler writes :data:`SPECIALISED_SIZE` into the message of a size it specialised,
:data:`FAILED_MODEL_CHECK` into that of a check the model makes on tensor values, and
train.py looks for them (:data:`RUN_TIME_CHECKS`) to explain a stage's failed check;
``autopipe verify`` and train.py raise :class:`PipelineRunError`.
"""

from __future__ import annotations

import os
import traceback

__all__ = [
    "FAILED_MODEL_CHECK",
    "RUN_TIME_CHECKS",
    "SPECIALISED_SIZE",
    "PipelineRunError",
    "UserCodeError",
    "first_line",
    "user_line",
]

#: in the message of the checks generated code makes of sizes computed from tensor values
SPECIALISED_SIZE = "the pipeline was compiled for that size"
#: in the message of the checks generated code makes where the model checks tensor values
FAILED_MODEL_CHECK = "the model's own check failed for this batch"
#: the words train.py looks for to explain a stage's failed check
RUN_TIME_CHECKS = (SPECIALISED_SIZE, FAILED_MODEL_CHECK)


class PipelineRunError(RuntimeError):
    """A problem with how the pipeline was started or fed; printed without a traceback, by rank 0
    alone when ``every_rank`` finds the same problem."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank
        #: a lower rank that meets the same problem (it reads the same batch) and says it
        self.also_on: int | None = None


def first_line(exc: BaseException) -> str:
    """An exception's message in one line (its first), or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: this runtime's folder: its frames are not the user's
_RUNTIME_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: the standard library's folder: not the user's either, but for the packages installed in it
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


class UserCodeError(PipelineRunError):
    """An exception raised by user code the run calls: ``option`` (``--data``, ``--loss``) is
    where the code came from, ``spec`` names it (``FILE.py:FN``), ``step`` is the optimizer step
    it was called for (None until known). Its message names the line of the user's code that
    raised; :attr:`original` keeps the exception, with its traceback, for the log."""

    def __init__(
        self, option: str, spec: str, original: BaseException, step: int | None = None
    ) -> None:
        self.option, self.spec, self.original, self.step = option, spec, original, step
        line = user_line(original)
        where = f" ({line})" if line else ""
        at = f" at step {step}" if step is not None else ""
        super().__init__(
            f"{option} {spec} raised{at}: {type(original).__name__}: {first_line(original)}{where}"
        )

    def at_step(self, step: int) -> UserCodeError:
        """This error, saying which step it was raised at."""
        if self.step is not None:
            return self
        stepped = UserCodeError(self.option, self.spec, self.original, step)
        stepped.also_on = self.also_on
        return stepped


def user_line(exc: BaseException) -> str | None:
    """``FILE:LINE`` of the innermost frame of ``exc``'s traceback outside this runtime, torch
    and the standard library: the line of user code that raised (None if there is none)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        installed = "site-packages" in path or "dist-packages" in path
        if f"{os.sep}torch{os.sep}" in path or path.startswith(_RUNTIME_DIR):
            continue
        if installed or not path.startswith(_STDLIB_DIR):
            shown = os.path.relpath(path)
            return f"{path if shown.startswith('..') else shown}:{frame.lineno}"
    return None
