"""What the benchmarks share: running autopipe and train.py as a user would, in subprocesses."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str], cwd: Path = REPO) -> str:
    """Output of a command (one intra-op thread, as torchrun gives each rank); raises with its
    tail when it fails."""
    result = subprocess.run(
        command,
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=3600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}")
    return result.stdout
