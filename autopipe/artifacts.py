"""Versioned JSON artefacts and atomic file writes.

Each step of the compiler writes one artefact: ``{"format": "autopipe.<kind>", "version": N,
...payload}``. Reading checks both, so a file from another step or another autopipe version gets a
clear error instead of a crash halfway through the next step.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import ArtifactError

#: Bumped whenever the layout of an artefact changes incompatibly.
ARTIFACT_VERSION = 1


def dumps(data: Any) -> str:
    """Deterministic JSON text: fixed indentation, no NaN, trailing newline."""
    return json.dumps(data, indent=1, allow_nan=False) + "\n"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; an artefact is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def artifact_text(kind: str, payload: dict) -> str:
    """The JSON text of an artefact of ``kind``."""
    return dumps({"format": f"autopipe.{kind}", "version": ARTIFACT_VERSION, **payload})


def write_artifact(path: str | os.PathLike, kind: str, payload: dict) -> None:
    atomic_write_text(path, artifact_text(kind, payload))


def read_artifact(path: str | os.PathLike, kind: str) -> dict:
    """Read an artefact of the given kind, checking its format and version."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(
            f"{path}: not valid JSON ({exc}); the file is corrupted, write it again"
        ) from None
    expected = f"autopipe.{kind}"
    if not isinstance(data, dict) or data.get("format") != expected:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ArtifactError(f"{path}: expected an {expected} artefact, found {found!r}")
    if data.get("version") != ARTIFACT_VERSION:
        raise ArtifactError(
            f"{path}: {expected} version {data.get('version')!r} cannot be read by this autopipe "
            f"(it reads version {ARTIFACT_VERSION}); produce the file again with this version"
        )
    return data
