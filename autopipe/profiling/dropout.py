"""Dropout as a GPU runs it, on fake CPU tensors standing for a GPU's (the analytic profile of a
GPU's spec).

``aten.dropout`` picks its implementation by the input's device: on a GPU, torch's fused
``native_dropout``, which saves a one-byte boolean mask for the backward; on a CPU, a random
tensor of the input's dtype multiplied in, which the product saves (four bytes an element in
fp32). A profile of a GPU's spec run on fake CPU tensors would count the CPU's mask, four times
what the GPU keeps, once for every dropout of every microbatch in flight. :func:`gpu_dropout`
routes the call to ``native_dropout`` on fake tensors, as a GPU's check routes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

from ..runtime.core.aten_kernels import aten_kernels

__all__ = ["gpu_dropout"]

_DROPOUT = torch.ops.aten.dropout.default


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if not is_fake(input) or not train or not 0 < p < 1 or not input.is_floating_point():
        out: torch.Tensor = _DROPOUT.decompose(input, p, train)  # torch's composite
        return out
    fused: torch.Tensor = torch.ops.aten.native_dropout.default(input, p, train)[0]
    return fused


@contextmanager
def gpu_dropout() -> Iterator[None]:
    """Within it, ``dropout`` on fake CPU tensors runs ``native_dropout`` (a GPU's fused kernel,
    keeping a boolean mask): an implementation for the CPU's autograd key, ahead of the
    composite one, removed on exit. Other calls (real tensors, none in a profile; evaluation;
    integer inputs) run torch's composite dropout."""
    with aten_kernels([("dropout", _dropout, "AutogradCPU")]):
        yield
