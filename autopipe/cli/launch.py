"""The launch command ``compile`` and ``replan`` print for the package they write."""

from __future__ import annotations

import shlex
from pathlib import Path

from ..partitioning import Partition

__all__ = ["torchrun"]


def torchrun(part: Partition, package: Path) -> str:
    """The torchrun command of one node running the package's pipeline on its devices."""
    processes = len(set(part.device_of_stage)) * (part.settings.dp_shard or 1)
    processes *= part.settings.tp or 1
    return f"torchrun --nproc-per-node={processes} {shlex.quote(str(package / 'train.py'))}"
