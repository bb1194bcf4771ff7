"""The errors autopipe reports to its users.

Every error says what is wrong and what to do about it; the CLI prints the message without a
traceback. Errors raised from deep inside torch are translated into one of these at the boundary
of the step that hit them.
"""

from __future__ import annotations


class AutopipeError(Exception):
    """Base class: a problem with the user's input that the user can fix."""


class SpecError(AutopipeError):
    """A model spec (``FILE.py:FUNCTION`` or ``package.module:FUNCTION``) is unusable."""


class TraceError(AutopipeError):
    """The model cannot be captured by ``torch.export``."""


class ArtifactError(AutopipeError):
    """A JSON artefact is missing, corrupted, or from another version of autopipe."""


class PartitionError(AutopipeError):
    """No valid partition exists for the requested stages and devices."""


class DeviceMemoryError(PartitionError):
    """No partition keeps every device within its memory. ``need`` is the sentence saying what
    the closest one needs against the device's capacity, ``peak`` the bytes its fullest rank
    needs, ``advice`` what would fit (empty when not worked out)."""

    def __init__(self, need: str, advice: str = "", *, peak: float = 0.0):
        super().__init__(f"{need}. {advice}" if advice else need)
        self.need = need
        self.advice = advice
        self.peak = peak


class OutputExistsError(AutopipeError):
    """The output exists and autopipe may not replace it: ``--force`` was not given, or it is
    not a pipeline autopipe generated."""


class OutputLockedError(AutopipeError):
    """Another autopipe process is writing the output directory right now."""


class WriteError(AutopipeError):
    """An output could not be written (no space left on the device, no permission)."""


class VerificationError(AutopipeError):
    """A generated pipeline does not match the original model."""
