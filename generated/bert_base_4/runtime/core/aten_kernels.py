"""Kernels of torch's own operators, registered for the duration of a ``with`` block.

Copied into every generated pipeline as ``runtime/core/aten_kernels.py``; it needs only torch.
Where a run on fake tensors must behave as another device does (a GPU's attention kernel, its
dropout, its autocast policy), an implementation is registered for one dispatch key of an
``aten`` operator, ahead of torch's own, and removed on exit, whatever the block raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["aten_kernels"]


@contextmanager
def aten_kernels(kernels: Iterable[tuple[str, Callable[..., Any], str]]) -> Iterator[None]:
    """Within it, each ``(operator, implementation, dispatch key)`` of ``kernels`` runs that
    ``aten`` operator (``"dropout"``, ``"pow.Tensor_Scalar"``) for that key (``"AutogradCPU"``,
    ``"AutocastCPU"``); all are removed on exit."""
    library: Any = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        for operator, implementation, key in kernels:
            library.impl(operator, implementation, key)
        yield
    finally:
        library._destroy()
