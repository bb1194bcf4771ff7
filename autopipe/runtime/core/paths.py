"""Paths given for files to write: whether one names a directory instead.

Copied into every generated pipeline as ``runtime/core/paths.py``; it needs only the standard
library. ``autopipe``'s options that write a file (:mod:`autopipe.cli.output_file`) and train.py's
``--save`` and ``--log-json`` (``runtime/guards.py``) refuse such a path.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["names_a_directory"]

#: what a path naming a directory may end with
_SEPARATORS = tuple(sep for sep in (os.sep, os.altsep) if sep)


def names_a_directory(value: str) -> bool:
    """Whether ``value``, given for a file to write, names a directory: one that exists, or any
    path ending with a separator (which ``Path`` drops: ``Path("ck/")`` is a file ``ck``)."""
    return value.endswith(_SEPARATORS) or Path(value).is_dir()
