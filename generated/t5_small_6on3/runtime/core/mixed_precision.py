"""bf16 mixed precision as ``train.py --bf16`` runs a stage: autocast over the fp32 parameters.

Copied into every generated pipeline as ``runtime/core/mixed_precision.py``; it needs only torch.
The compiler profiles each unit under the same context (``autopipe.profiling.precision``), so a
plan made ``--bf16`` casts as the run does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["AUTOCAST_DTYPE", "bf16_autocast"]

#: the dtype ``--bf16`` computes products in (autocast's) and FSDP2 gathers parameters in
AUTOCAST_DTYPE = torch.bfloat16


def bf16_autocast(device_type: str | None) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device_type`` (cuda, cpu), or nothing where it is None."""
    if device_type is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPE)
