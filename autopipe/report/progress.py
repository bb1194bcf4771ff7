"""Progress of ``autopipe compile`` and ``plan`` on the terminal: a spinner while a phase runs
(with how far it is, where the phase says: the plan search's candidates), then its time (and with
``--verbose`` what it produced). Plain lines when stderr is not a terminal."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.status import Status

QUIET, NORMAL, VERBOSE = 0, 1, 2


class Phases:
    """Reports compiler phases at one of three levels: QUIET, NORMAL or VERBOSE."""

    def __init__(self, level: int = NORMAL):
        self.level = level
        self.console = Console(stderr=True, highlight=False)
        self.timings: dict[str, float] = {}
        self._status: Status | None = None  # the running phase's line on a terminal
        self._name = ""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[list[str]]:
        """Time the phase ``name``; the caller may append details to the yielded list."""
        details: list[str] = []
        start = time.perf_counter()
        status = (
            self.console.status(f"{name} ...", spinner="dots")
            if self.level > QUIET and self.console.is_terminal
            else None
        )
        self._status, self._name = status, name
        try:
            with status or contextlib.nullcontext():
                yield details
        finally:
            self._status = None
        self.timings[name] = time.perf_counter() - start
        if self.level > QUIET:
            line = f"{name:<9} {self.timings[name]:7.2f} s"
            if self.level >= VERBOSE and details:
                line += "  " + "; ".join(details)
            self.console.print(line, markup=False)

    def progress(self, message: str) -> None:
        """How far the running phase is, on its line: on a terminal only (a pipe gets the
        phase's time when it ends, not every step of it)."""
        if self._status is not None:
            self._status.update(f"{self._name} ... {message}")

    def note(self, message: str) -> None:
        """A message shown unless QUIET: something the user should know about the result."""
        if self.level > QUIET:
            self.console.print(message, markup=False)

    def __call__(self, message: str) -> None:
        """A message shown at VERBOSE level."""
        if self.level >= VERBOSE:
            self.console.print(message, markup=False)
