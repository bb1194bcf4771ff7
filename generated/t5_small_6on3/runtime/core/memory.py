"""Counting the bytes of live tensors: how autopipe's profiler measures what a unit adds and how
train.py's ``--track-memory`` measures a CPU run's peak, one rule for both.

Copied into every generated pipeline as ``runtime/core/memory.py``; it needs only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorBytes"]


# torch leaves TorchDispatchMode.__init_subclass__ unannotated
class LiveTensorBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The most bytes of tensor storage alive at once while active: every operator's outputs
    are counted until their storage is freed (views share their base's). CPU runs use it for
    ``--track-memory``, where the process's resident size would count the allocator's caches and
    the interpreter, and ``--dry-run`` counts the fake tensors on the run's device (FakeTensor's
    storages have sizes and are freed as real ones are); it slows every operator down. Storages in ``existing`` (and results of
    in-place operators on them) are not counted: the profiler measures what a unit adds."""

    def __init__(
        self,
        existing: set[StorageWeakRef] | frozenset[StorageWeakRef] = frozenset(),
        device_type: str | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: unannotated
        self.existing = existing
        self.device_type = device_type  # count only tensors on this type of device (None: any)
        self.live: dict[StorageWeakRef, int] = {}
        self.bytes = 0
        self.peak = 0
        self.active = False

    def __enter__(self) -> LiveTensorBytes:
        self.active = True
        entered: LiveTensorBytes = super().__enter__()  # type: ignore[no-untyped-call]  # torch
        return entered

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.active = False
        super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]  # torch

    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        self.count(out)
        return out

    def count(self, out: object) -> None:
        """Counts the storage of an operator's outputs ``out`` until it is freed; the storages
        freed since the last operator stop counting."""
        expired = [r for r in self.live if r.expired()]  # type: ignore[no-untyped-call]  # torch
        for ref in expired:
            self.bytes -= self.live.pop(ref)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and self.counts(tensor.device):
                ref = StorageWeakRef(tensor.untyped_storage())  # type: ignore[no-untyped-call]  # torch
                if ref not in self.live and ref not in self.existing:
                    self.live[ref] = tensor.untyped_storage().nbytes()
                    self.bytes += self.live[ref]
        self.peak = max(self.peak, self.bytes)

    def counts(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are counted: never on meta (no storage), else those
        of ``device_type`` when given (a fake CUDA run's CPU tensors stay out)."""
        if self.device_type is not None:
            return device.type == self.device_type
        return device.type != "meta"
