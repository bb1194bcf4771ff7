"""The exact optimum over contiguous splits of the units' program order (``--method dp``).

Stages are contiguous ranges of units. Dynamic programming over (stages used, units covered)
minimises the slowest stage, communication included (:func:`.cost.stage_time`); among the partitions reaching that optimum
it then minimises the sum of squared stage times (the most balanced one). Stages whose memory exceeds the device are not
allowed. ``O(stages x units^2)`` work, vectorised over the start of the last stage.
"""

from __future__ import annotations

import math

import torch

from ..errors import PartitionError
from .cost import CostModel, in_flight


def solve_contiguous(model: CostModel, num_stages: int) -> list[int]:
    """``stage_of_unit`` of the best contiguous partition into ``num_stages`` non-empty stages
    (memoised on the cost model: several methods start from it)."""
    if num_stages not in model.contiguous_optimum:
        model.contiguous_optimum[num_stages] = _solve(model, num_stages)
    return list(model.contiguous_optimum[num_stages])


def _solve(model: CostModel, num_stages: int) -> list[int]:
    n = model.num_units
    if num_stages > n:
        raise PartitionError(
            f"{num_stages} stages need at least {num_stages} units, but the graph has {n}; use fewer "
            "stages, or a larger --depth / fewer --basic-blocks so the model splits into more units"
        )
    dtype = torch.float64

    def prefix(values) -> torch.Tensor:
        out = torch.zeros(n + 1, dtype=dtype)
        out[1:] = torch.cumsum(torch.tensor(values, dtype=dtype), 0)
        return out

    fwd, bwd = prefix(model.forward), prefix(model.backward)
    act, par = prefix(model.activations), prefix(model.param_bytes)
    bandwidth = model.device.link_bandwidth
    edges = (
        []
    )  # (forward, backward) seconds a stage spends on the cut before unit i / after unit j-1
    for moved in model.boundary_bytes():
        at = torch.zeros(n + 1, dtype=dtype)
        at[1:n] = torch.tensor(moved, dtype=dtype) / bandwidth
        edges.append(at)
    cut_forward, cut_backward = edges
    capacity = model.device.memory
    microbatches = model.microbatches or 2 * num_stages

    def stage_costs(j: int, k: int, starts: torch.Tensor) -> torch.Tensor:
        """Cost of stage ``k`` covering units ``starts .. j - 1`` for each start (transfers
        overlap compute: max(forward, comm forward) + max(backward, comm backward))."""
        forward = torch.maximum(fwd[j] - fwd[starts], cut_forward[starts] + cut_forward[j])
        backward = torch.maximum(bwd[j] - bwd[starts], cut_backward[starts] + cut_backward[j])
        cost = forward + backward
        memory = (par[j] - par[starts]) * model.state_factor() + (act[j] - act[starts]) * in_flight(
            k, num_stages, model.schedule, microbatches
        )
        return torch.where(memory <= capacity, cost, torch.full_like(cost, math.inf))

    inf = math.inf
    # best[k][j]: least bottleneck covering units 0..j-1 with stages 0..k-1
    best = torch.full((num_stages + 1, n + 1), inf, dtype=dtype)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            starts = torch.arange(k - 1, j)
            candidates = torch.maximum(best[k - 1, starts], stage_costs(j, k - 1, starts))
            best[k, j] = candidates.min()
    optimum = float(best[num_stages, n])
    if not math.isfinite(optimum):
        raise PartitionError(_memory_message(model, num_stages, microbatches))
    # among partitions with that bottleneck, the most balanced (least sum of squares); ties -> earliest cut
    limit = optimum * (1 + 1e-9)
    total = torch.full((num_stages + 1, n + 1), inf, dtype=dtype)
    choice = torch.zeros((num_stages + 1, n + 1), dtype=torch.long)
    total[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            starts = torch.arange(k - 1, j)
            cost = stage_costs(j, k - 1, starts)
            value = torch.where(
                cost <= limit, total[k - 1, starts] + cost * cost, torch.full_like(cost, inf)
            )
            i = int(torch.argmin(value))
            total[k, j] = value[i]
            choice[k, j] = starts[i]
    stage_of_unit = [0] * n
    j = n
    for k in range(num_stages, 0, -1):
        i = int(choice[k, j])
        for u in range(i, j):
            stage_of_unit[u] = k - 1
        j = i
    return stage_of_unit


def _memory_message(model: CostModel, num_stages: int, microbatches: int) -> str:
    state = sum(model.param_bytes) * model.state_factor()
    activations = sum(model.activations) * microbatches
    need = (state + activations) / num_stages / 1024**3
    return (
        f"no split into {num_stages} stages fits the memory of {model.device.name} "
        f"({model.device.memory / 1024**3:.1f} GiB per device): parameters, gradients and optimizer "
        f"state take {state / 1024**3:.1f} GiB and activations up to {activations / 1024**3:.1f} GiB, about "
        f"{need:.1f} GiB per stage. Use at least {math.ceil((state + activations) / model.device.memory)} "
        "stages, fewer microbatches in flight, or a device with more memory (--device-spec)."
    )
