"""What a pipeline's run reports: its error, messages in one line, and the words of the size
checks generated code makes.

Copied into every generated pipeline as ``runtime/core/errors.py``; it needs only the standard
library. The compiler writes :data:`SPECIALISED_SIZE` into the message of a size it specialised
and train.py looks for it to explain a stage's failed check; ``autopipe verify`` and train.py
raise :class:`PipelineRunError`.
"""

from __future__ import annotations

__all__ = ["SPECIALISED_SIZE", "PipelineRunError", "first_line"]

#: in the message of the checks generated code makes of sizes computed from tensor values
SPECIALISED_SIZE = "the pipeline was compiled for that size"


class PipelineRunError(RuntimeError):
    """A problem with how the pipeline was started or fed; printed without a traceback, by rank 0
    alone when ``every_rank`` finds the same problem."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


def first_line(exc: BaseException) -> str:
    """An exception's message in one line (its first), or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
