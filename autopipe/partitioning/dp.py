"""The exact optimum over contiguous splits of the units' program order (``--method dp``).

Stages are contiguous ranges of units. Dynamic programming over (stages used, units covered)
minimises the slowest stage, communication included (:func:`.cost.stage_time`); among the partitions reaching that optimum
it then minimises the sum of squared stage times (the most balanced one). Stages whose memory exceeds the device are not
allowed. ``O(stages x units^2)`` work, vectorised over the start of the last stage.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..byte_units import format_bytes, format_bytes_each
from ..errors import DeviceMemoryError, PartitionError
from ..runtime.core.pipeline import default_microbatches
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

    def prefix(values: Sequence[float]) -> torch.Tensor:
        out = torch.zeros(n + 1, dtype=dtype)
        out[1:] = torch.cumsum(torch.tensor(values, dtype=dtype), 0)
        return out

    fwd, bwd = prefix(model.forward), prefix(model.backward)
    act, par, trn = (
        prefix(v) for v in (model.activations, model.param_bytes, model.trainable_bytes)
    )
    trained, frozen = model.state_factors()
    bandwidth = model.device.link_bandwidth
    # seconds a stage spends on the cut before its first unit i / after its last unit j - 1
    cut_forward, cut_backward = (torch.zeros(n + 1, dtype=dtype) for _ in range(2))
    moved_forward, moved_backward = model.boundary_bytes()
    cut_forward[1:n] = torch.tensor(moved_forward, dtype=dtype) / bandwidth
    cut_backward[1:n] = torch.tensor(moved_backward, dtype=dtype) / bandwidth
    capacity = model.device.memory
    microbatches = model.microbatches or default_microbatches(num_stages)
    positions = torch.arange(n + 1)

    def stage_costs(k: int, rows: slice, ends: slice) -> torch.Tensor:
        """Cost of stage ``k`` covering units i .. j - 1, for starts i in ``rows`` and ends j in
        ``ends``; infinite where i >= j or the stage does not fit in memory. Transfers overlap
        compute: max(forward, comm forward) + max(backward, comm backward)."""
        i, j = positions[rows].unsqueeze(1), positions[ends].unsqueeze(0)
        forward = torch.maximum(fwd[j] - fwd[i], cut_forward[i] + cut_forward[j])
        backward = torch.maximum(bwd[j] - bwd[i], cut_backward[i] + cut_backward[j])
        held = in_flight(k, num_stages, model.schedule, microbatches)
        trainable = trn[j] - trn[i]
        state = trainable * trained + (par[j] - par[i] - trainable) * frozen
        memory = state + (act[j] - act[i]) * held
        valid = (i < j) & (memory <= capacity)
        return torch.where(valid, forward + backward, torch.full_like(forward, math.inf))

    # A stage of the optimum costs at most the equal-compute split's slowest stage, and at least
    # its own compute: each end j only needs the starts within that band of compute.
    compute = fwd + bwd
    bound = _equal_split_bound(compute, num_stages, stage_costs)
    lowest = (
        torch.searchsorted(compute, compute - bound * (1 + 1e-9) - 1e-15)
        if math.isfinite(bound)
        else torch.zeros(n + 1, dtype=torch.long)
    )
    block = max(1, (1 << 22) // (n + 1))  # columns per step: bounds memory on huge graphs
    blocks = []
    for first in range(0, n + 1, block):
        ends = slice(first, min(n + 1, first + block))
        blocks.append((slice(int(lowest[first]), ends.stop), ends))

    inf = math.inf
    # best[k][j]: least bottleneck covering units 0..j-1 with stages 0..k-1
    best = torch.full((num_stages + 1, n + 1), inf, dtype=dtype)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for rows, ends in blocks:
            candidates = torch.maximum(
                best[k - 1, rows].unsqueeze(1), stage_costs(k - 1, rows, ends)
            )
            best[k, ends] = candidates.min(0).values
    optimum = float(best[num_stages, n])
    if not math.isfinite(optimum):
        raise memory_error(model, num_stages)
    # among partitions with that bottleneck, the most balanced (least sum of squares); ties -> earliest cut
    limit = optimum * (1 + 1e-9)
    total = torch.full((num_stages + 1, n + 1), inf, dtype=dtype)
    choice = torch.zeros((num_stages + 1, n + 1), dtype=torch.long)
    total[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for rows, ends in blocks:
            cost = stage_costs(k - 1, rows, ends)
            value = torch.where(cost <= limit, total[k - 1, rows].unsqueeze(1) + cost * cost, inf)
            total[k, ends], index = value.min(0)
            choice[k, ends] = index + rows.start
    stage_of_unit = [0] * n
    j = n
    for k in range(num_stages, 0, -1):
        i = int(choice[k, j])
        for u in range(i, j):
            stage_of_unit[u] = k - 1
        j = i
    return stage_of_unit


def _equal_split_bound(
    compute: torch.Tensor,
    num_stages: int,
    stage_costs: Callable[[int, slice, slice], torch.Tensor],
) -> float:
    """The slowest stage (communication and memory included) of the split into stages of equal
    compute: an upper bound on the optimum's bottleneck, or infinity if a stage does not fit."""
    n = compute.numel() - 1
    targets = compute[-1] * torch.arange(1, num_stages, dtype=compute.dtype) / num_stages
    cuts = torch.searchsorted(compute, targets).clamp(1, n - 1).tolist()
    bounds = sorted(set([0, *cuts, n]))
    if len(bounds) != num_stages + 1:
        return math.inf
    costs = [
        float(stage_costs(k, slice(a, a + 1), slice(b, b + 1)))
        for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]
    return max(costs)


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds as the contiguous split counts it: its parameters, gradients and
    optimizer state, and the activations of the microbatches it holds in flight."""

    state: float
    activations: float
    in_flight: int

    @property
    def total(self) -> float:
        return self.state + self.activations


def least_memory_split(model: CostModel, num_stages: int) -> list[StageMemory]:
    """Each stage's memory, as :func:`solve_contiguous` counts it, in the contiguous split into
    ``num_stages`` stages whose fullest stage holds the least."""
    n = model.num_units
    params = list(itertools.accumulate(model.param_bytes, initial=0))
    trainable = list(itertools.accumulate(model.trainable_bytes, initial=0))
    saved = list(itertools.accumulate(model.activations, initial=0.0))
    microbatches = model.microbatches or default_microbatches(num_stages)
    held = [in_flight(k, num_stages, model.schedule, microbatches) for k in range(num_stages)]

    def state(first: int, end: int) -> float:
        return model.state_bytes(params[end] - params[first], trainable[end] - trainable[first])

    def memory(stage: int, first: int, end: int) -> float:
        return state(first, end) + (saved[end] - saved[first]) * held[stage]

    def starts_within(capacity: float) -> list[int] | None:
        """The first unit of each stage of a split whose every stage holds at most ``capacity``,
        or None if there is none: stages packed from the last one back, each taking as many
        units as fit (a stage holds no more microbatches than the one before it, so a unit that
        fits a stage fits every later one, and this finds a split whenever one exists)."""
        starts = [0] * num_stages
        end = n
        for stage in reversed(range(num_stages)):
            first = end - 1
            if first < stage or memory(stage, first, end) > capacity:
                return None
            while first > stage and memory(stage, first - 1, end) <= capacity:
                first -= 1
            starts[stage], end = first, first
        return starts if end == 0 else None

    low, high = 0.0, memory(0, 0, n)  # one stage holding everything bounds any split's stage
    for _ in range(64):
        middle = (low + high) / 2
        if starts_within(middle) is None:
            low = middle
        else:
            high = middle
    starts = starts_within(high)
    assert starts is not None  # ``high`` always admits a split
    ends = [*starts[1:], n]
    return [
        StageMemory(
            state(first, end),
            (saved[end] - saved[first]) * held[stage],
            held[stage],
        )
        for stage, (first, end) in enumerate(zip(starts, ends))
    ]


def memory_error(model: CostModel, num_stages: int) -> DeviceMemoryError:
    """No contiguous split into ``num_stages`` stages fits: what the least a split needs is."""
    stages = least_memory_split(model, num_stages)
    fullest = max(range(num_stages), key=lambda s: stages[s].total)
    worst = stages[fullest]
    shards = model.dp_shard
    sharded = f", its 1/{shards} share under --dp-shard {shards}" if shards > 1 else ""
    recomputed = held = ""
    if model.recomputes_all:
        recomputed = " even with every stage's activations recomputed"
    else:
        microbatches = f"{worst.in_flight} microbatch{'es' if worst.in_flight != 1 else ''}"
        held = f" and {format_bytes(worst.activations)} of activations for {microbatches} in flight"
    split = f"{num_stages} stage{'s' if num_stages != 1 else ''}"
    need = (
        f"no split into {split} fits the memory of {model.device.name} "
        f"({format_bytes(model.device.memory)} per device){recomputed}: the split needing the "
        f"least memory needs at least {format_bytes_each([s.total for s in stages], 'stage')} "
        f"(stage {fullest}: {format_bytes(worst.state)} of parameters, gradients and optimizer "
        f"state{sharded}{held})"
    )
    return DeviceMemoryError(need, peak=worst.total)
