"""A generated package's files against the digests its ``manifest.json`` records.

Copied into every generated pipeline as ``runtime/core/manifest.py``; it needs only the standard
library. train.py warns when its package's files were edited; ``autopipe verify`` reports them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["changed_files"]


def changed_files(directory: Path, digests: dict[str, str]) -> list[str]:
    """The files of ``digests`` (relative path -> SHA-256) that ``directory`` holds with
    another digest, or not at all, in the order given."""
    changed = []
    for rel, digest in digests.items():
        try:
            if hashlib.sha256((directory / rel).read_bytes()).hexdigest() != digest:
                changed.append(rel)
        except OSError:
            changed.append(rel)
    return changed
