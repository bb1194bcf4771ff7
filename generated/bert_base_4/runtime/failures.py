"""Which rank failed first, for the ranks that stop because of it.

Copied into every generated pipeline as ``runtime/failures.py``; it needs only torch. A rank
that fails prints its own error and posts a line on the run's board: a key of the store
torchrun's agent keeps (``MASTER_ADDR:MASTER_PORT``), which outlives the failed process. The
ranks torchrun then stops, or that lose contact with the failed one, read the board and say
that they stopped because of that rank, instead of a "lost contact" that hides the cause. Keys
are per restart attempt (``TORCHELASTIC_RESTART_COUNT``), so an elastic restart starts clean.
The hang diagnosis (``hangs.py``) exchanges its reports through the same store
(:func:`agent_store`, under :func:`attempt_prefix`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["FailureBoard", "agent_store", "attempt_prefix"]

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
