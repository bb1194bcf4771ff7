"""Measuring a device as a torchrun rank computes on it.

A calibration and a measured profile time what train.py's ranks will run, so they measure
under a rank's conditions: its intra-op threads (one each where torchrun starts several ranks
on a node), and on a CPU the host memory it keeps for the next microbatch
(:mod:`autopipe.runtime.core.host_memory`). Both are the caller's again afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from ..runtime.core.host_memory import host_memory_retained

__all__ = ["as_a_rank_runs"]


@contextmanager
def as_a_rank_runs(device: torch.device, threads: int) -> Iterator[None]:
    """Inside: torch computes with ``threads`` intra-op threads and, on a CPU, freed host
    memory is kept for reuse, as train.py's ranks have it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with host_memory_retained() if device.type == "cpu" else nullcontext(False):
            yield
    finally:
        torch.set_num_threads(before)
