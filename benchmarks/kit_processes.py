"""What the GPU kit (benchmarks/gpu.py) and the parity ladder (benchmarks/parity.py) share: each
measurement runs in a fresh process of this repository's Python, one intra-op thread, warnings
off; a process that fails or runs out of time raises :class:`Failed` with the end of its
output; a run's ``--budget`` (:class:`Budget`) bounds every process it starts, and a measurement
that cannot start in what is left raises :class:`OutOfTime`."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPO", "Budget", "Failed", "OutOfTime", "environment", "run"]

REPO = Path(__file__).resolve().parents[1]


class Failed(Exception):
    """A subprocess of the kit failed; the message holds the end of its output."""


class OutOfTime(Exception):
    """Too little of the ``--budget`` is left to start a measurement: it is skipped, and its
    row says so."""


@dataclass(frozen=True)
class Budget:
    """A run's ``--budget``: the ``time.monotonic()`` by which it ends (None: no end)."""

    deadline: float | None = None

    @classmethod
    def of(cls, seconds: float | None) -> Budget:
        """The budget of ``seconds`` from now (None: none)."""
        return cls(None if seconds is None else time.monotonic() + seconds)

    def timeout(self, seconds: float, least: float = 20.0) -> float:
        """``seconds`` for a measurement, cut to what is left (:class:`OutOfTime` when that
        is under ``least``)."""
        if self.deadline is None:
            return seconds
        left = self.deadline - time.monotonic()
        if left < least:
            raise OutOfTime(f"{max(left, 0):.0f} s of --budget left")
        return min(seconds, left)


def environment() -> dict[str, str]:
    """The environment of a measurement: this repository importable, one thread, no warnings."""
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=python_path, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def run(command: list[str], timeout: float) -> str:
    """Run ``command`` in the repository; its standard output (its standard error goes into the
    message of the :class:`Failed` it raises when it fails or times out)."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise Failed(f"timed out after {timeout:.0f} s: {' '.join(command[:8])} ...") from exc
    if done.returncode != 0:
        tail = (done.stdout[-1500:] + "\n" + done.stderr[-3000:]).strip()
        raise Failed(
            f"exit {done.returncode} after {time.perf_counter() - started:.0f} s: "
            f"{' '.join(command[:8])} ...\n{tail}"
        )
    return done.stdout
