"""Which rank failed first, for the ranks that stop because of it.

Copied into every generated pipeline as ``runtime/failures.py``; it needs only torch. A rank
that fails prints its own error and posts a line on the run's board: a key of the store
torchrun's agent keeps (``MASTER_ADDR:MASTER_PORT``), which outlives the failed process. The
ranks torchrun then stops, or that lose contact with the failed one, read the board and say
that they stopped because of that rank, instead of a "lost contact" that hides the cause. Keys
are per restart attempt (``TORCHELASTIC_RESTART_COUNT``), so an elastic restart starts clean.
The hang diagnosis (``hangs.py``) exchanges its reports through the same store
(:func:`agent_store`, under :func:`attempt_prefix`). A failure's full traceback goes to a log
file of its own (:func:`write_error_log`), created anew (``O_EXCL``, a random name, readable by
its owner only) in a directory only its user can enter: a name planted in ``/tmp`` beforehand is
never followed or overwritten.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

__all__ = [
    "FailureBoard",
    "agent_store",
    "attempt_prefix",
    "error_log_directory",
    "write_error_log",
]

#: how long a rank waits for the store before it does without the board
_STORE_TIMEOUT = timedelta(seconds=5)


def attempt_prefix() -> str:
    """``autopipe/RUN/attempt-N/``: the start of this restart attempt's keys in the store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"autopipe/{run}/attempt-{attempt}/"


def agent_store(world_size: int) -> dist.Store | None:
    """A client of the store torchrun's agent keeps (``MASTER_ADDR:MASTER_PORT``), or None in a
    run of one process, without torchrun, or when the store does not answer."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or not host or not port or not port.isdigit():
        return None
    try:
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
    except (RuntimeError, ValueError, OSError):
        return None


class FailureBoard:
    """The failures of this run's ranks; every method does nothing (or finds nothing) when the
    run has no torchrun store, or the store no longer answers."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.prefix = f"{attempt_prefix()}failed/"
        self._store: dist.Store | None = None

    def _connect(self) -> dist.Store | None:
        if self._store is None:
            self._store = agent_store(self.world_size)
        return self._store

    def post(self, what: str) -> None:
        """Record that this rank failed, and how (one line)."""
        store = self._connect()
        if store is None:
            return
        try:
            store.set(f"{self.prefix}{self.rank}", what.splitlines()[0][:400] if what else "")
        except (RuntimeError, OSError):
            pass

    def posted(self, rank: int, wait: float) -> bool:
        """Whether ``rank`` posted a failure, waiting up to ``wait`` seconds for it."""
        store = self._connect()
        if store is None:
            return False
        deadline = time.monotonic() + wait
        while True:
            try:
                if store.check([f"{self.prefix}{rank}"]):
                    return True
            except (RuntimeError, OSError):
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def first_failed(self) -> int | None:
        """The lowest other rank that posted a failure, or None."""
        store = self._connect()
        if store is None:
            return None
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                if store.check([f"{self.prefix}{rank}"]):
                    return rank
            except (RuntimeError, OSError):
                return None
        return None


def error_log_directory() -> Path:
    """``TMPDIR/autopipe-UID``: this user's directory of error logs (and of the trained weights
    no other place took: ``guards.fallback_paths``), created private (0700); one that is not a
    directory of this user's that only they can enter (planted by another, a link) is not used:
    a new private one with a random name is made instead."""
    base = Path(tempfile.gettempdir())
    directory = base / f"autopipe-{os.getuid()}"
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        return Path(tempfile.mkdtemp(prefix="autopipe-", dir=base))
    try:
        info = os.lstat(directory)
    except OSError:
        info = None
    if (
        info is None
        or not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & 0o077
    ):
        return Path(tempfile.mkdtemp(prefix="autopipe-", dir=base))
    return directory


def write_error_log(text: str, rank: int) -> Path | None:
    """``text`` (a failure's traceback) in a new file of :func:`error_log_directory`, named
    ``train-error-rankR-*.log`` and created exclusively; its path, or None if it cannot be
    written."""
    try:
        fd, name = tempfile.mkstemp(
            prefix=f"train-error-rank{rank}-", suffix=".log", dir=error_log_directory()
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return None
    return Path(name)
