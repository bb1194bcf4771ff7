"""Versioned JSON artefacts and atomic file writes.

Each step of the compiler writes one artefact: ``{"format": "autopipe.<kind>", "version": N,
...payload}``. Reading checks both, so a file from another step or another autopipe version gets a
clear error instead of a crash halfway through the next step.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import ArtifactError, OutputExistsError, WriteError

#: Bumped whenever the layout of an artefact changes incompatibly.
ARTIFACT_VERSION = 1
#: the version of autopipe itself, which every package, report and ``--version`` states
AUTOPIPE_VERSION = "0.1.0"


def dumps(data: Any) -> str:
    """Deterministic JSON text: fixed indentation, no NaN, trailing newline."""
    return json.dumps(data, indent=1, allow_nan=False) + "\n"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; an artefact is an ordinary file
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_error(path, exc) from exc
        raise


def write_error(
    path: str | os.PathLike, exc: OSError, kept: str = "nothing was left half-written"
) -> WriteError:
    """The error to report when writing ``path`` failed with ``exc``; ``kept`` says what
    the failure left as it was."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return WriteError(
            f"no space left on device while writing {path}; free some space and run again ({kept})"
        )
    where = f" ({exc.filename})" if exc.filename else ""
    return WriteError(f"cannot write {path}: {exc.strerror or exc}{where} ({kept})")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def artifact_text(kind: str, payload: dict) -> str:
    """The JSON text of an artefact of ``kind``."""
    return dumps({"format": f"autopipe.{kind}", "version": ARTIFACT_VERSION, **payload})


def write_artifact(path: str | os.PathLike, kind: str, payload: dict) -> None:
    check_replaceable(path, kind)
    atomic_write_text(path, artifact_text(kind, payload))


def check_replaceable(path: str | os.PathLike, kind: str) -> None:
    """Refuse to write an artefact of ``kind`` over anything but an earlier one, so that a file
    given as the output by mistake (the model's source, say) is never overwritten."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    head = f'{{\n "format": "autopipe.{kind}"'.encode()
    try:
        with path.open("rb") as f:
            ours = path.is_file() and f.read(len(head)) == head
    except OSError:
        ours = False
    if not ours:
        raise OutputExistsError(
            f"{path} exists and is not an autopipe.{kind} artefact; autopipe will not overwrite "
            "it. Choose another output (-o), or remove the file yourself"
        )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number autopipe writes")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def read_artifact(path: str | os.PathLike, kind: str) -> dict:
    """Read an artefact of the given kind, checking its format and version."""
    path = Path(path)
    try:
        data = json.loads(
            path.read_text(encoding="utf-8"), parse_constant=_no_constant, parse_float=_finite
        )
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
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
