"""Random numbers drawn inside tensor-parallel regions: a stream of each rank's own.

The ranks of a tensor-parallel group share one random stream (the replicated code between
regions must draw the same dropout masks on every rank). Inside a sharded region each rank
holds other heads or features (or, sequence parallel, between regions other positions), and a
dropout there drawn from the shared stream would give every rank's share the same mask: heads
``h`` and ``h + H/t`` dropped together. Megatron-LM keeps a second stream per tensor-parallel
rank for these; so does generated code: each random operator of a sharded region is called
through :func:`on_rank_stream`, which draws one number from the shared stream (every rank the
same, so the shared stream stays in step) and seeds a stream of its own from it and the rank.
The stream follows from the shared one's state alone, so activation checkpointing, which
restores that state to recompute, draws the same masks again. Outside a tensor-parallel run
(one rank, ``autopipe verify``) it calls the operator as it is: the code draws what the model
draws. ``torch.compile`` leaves the call out of its graphs (it runs eagerly where it stands),
so the compiled code cannot draw from the shared stream instead.

Copied into every generated pipeline; needs only torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["on_rank_stream", "set_tensor_parallel_rank"]

#: this process's tensor-parallel (rank, degree); degree 1: no tensor parallelism
_PLACE = {"rank": 0, "degree": 1}
#: keys are drawn below this bound (key x degree + rank stays within a 64-bit seed)
_KEYS = 2**56


def set_tensor_parallel_rank(rank: int, degree: int) -> None:
    """Record this process's tensor-parallel rank and degree (train.py, as it builds its
    stages; degree 1 without tensor parallelism)."""
    if not 0 <= rank < degree:
        raise ValueError(f"tensor-parallel rank {rank} is not one of {degree}")
    _PLACE.update(rank=rank, degree=degree)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def on_rank_stream(operator: Any, *args: Any, **kwargs: Any) -> Any:
    """``operator(*args, **kwargs)`` under a random stream of this tensor-parallel rank's own
    (see the module), the shared stream advanced by one draw on every rank; the call as it is
    at degree 1."""
    if _PLACE["degree"] == 1:
        return operator(*args, **kwargs)
    key = int(torch.randint(_KEYS, (1,)).item())  # the shared CPU stream: the same on each rank
    seed = key * _PLACE["degree"] + _PLACE["rank"]
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    devices = [torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):  # restores the shared streams after
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)  # this device's generator alone
        return operator(*args, **kwargs)
