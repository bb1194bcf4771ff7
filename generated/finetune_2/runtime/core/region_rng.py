"""Random numbers drawn inside tensor-parallel regions: a stream of each rank's own.

The ranks of a tensor-parallel group share one random stream (the replicated code between
regions must draw the same dropout masks on every rank). Inside a sharded region each rank
holds other heads or features (or, sequence parallel, between regions other positions), and a
dropout there drawn from the shared stream would give every rank's share the same mask: heads
``h`` and ``h + H/t`` dropped together. Megatron-LM keeps a second stream per tensor-parallel
rank for these; so does generated code: each random operator of a sharded region runs under
:func:`tensor_parallel_rng`, which draws one number from the shared stream (every rank the
same, so the shared stream stays in step) and seeds a stream of its own from it and the rank.
The stream follows from the shared one's state alone, so activation checkpointing, which
restores that state to recompute, draws the same masks again. Outside a tensor-parallel run
(one rank, ``autopipe verify``) it does nothing: the code draws what the model draws.

Copied into every generated pipeline; needs only torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["set_tensor_parallel_rank", "tensor_parallel_rng"]

#: this process's tensor-parallel (rank, degree); degree 1: no tensor parallelism
_PLACE = {"rank": 0, "degree": 1}
#: keys are drawn below this bound (key x degree + rank stays within a 64-bit seed)
_KEYS = 2**56


def set_tensor_parallel_rank(rank: int, degree: int) -> None:
    """Record this process's tensor-parallel rank and degree (train.py, when it shards)."""
    if not 0 <= rank < degree:
        raise ValueError(f"tensor-parallel rank {rank} is not one of {degree}")
    _PLACE.update(rank=rank, degree=degree)


@contextmanager
def tensor_parallel_rng() -> Iterator[None]:
    """Run the block under a random stream of this tensor-parallel rank's own (see the
    module), the shared stream advanced by one draw on every rank; nothing at degree 1."""
    if _PLACE["degree"] == 1:
        yield
        return
    key = int(torch.randint(_KEYS, (1,)).item())  # the shared CPU stream: the same on each rank
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    devices = [torch.cuda.current_device()] if initialized else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(key * _PLACE["degree"] + _PLACE["rank"])
        yield
