"""The exact optimum over contiguous splits of the units' program order (``--method dp``).

Stages are contiguous ranges of units. Dynamic programming over (stages used, units covered)
minimises the slowest stage, communication included (:func:`.cost.stage_time`); among the partitions reaching that optimum
it then minimises the sum of squared stage times (the most balanced one). A stage whose activations (of the microbatches
the schedule keeps in flight on it) do not fit beside its training state pays for recomputing what does not fit, so a
balanced split that recomputes competes with shrinking the stages that hold the most microbatches; stages whose training
state alone exceeds the device are not allowed. ``O(stages x units^2)`` work, vectorised over the start of the last stage.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .byte_units import format_bytes, format_bytes_each
from ..errors import DeviceMemoryError, PartitionError
from ..runtime.core.pipeline import default_microbatches
from .cost import CostModel, in_flight
from .recompute import fastest_fitting

#: the contiguous optimum cuts inside a block (it is inline in its stages then, not a submodule
#: one can shard, recompute or compile) only when that makes the slowest stage this much faster
BLOCK_TOLERANCE = 0.10
#: the most stage-cost entries the DP computes at once (stages x starts x ends): bounds the
#: memory of its intermediate tensors
COSTED_AT_ONCE = 1 << 21
#: the most stage-cost entries a solve keeps from its first pass for its second (8 bytes each)
COSTS_KEPT = 1 << 24
#: the split solved again with each stage's uncounted memory reserved is of use only if its
#: slowest stage is at most this much slower than the first split's (whose own recomputation
#: the simulator then charges)
CALIBRATION_LIMIT = 0.5


def solve_contiguous(model: CostModel, num_stages: int) -> list[int]:
    """``stage_of_unit`` of the best contiguous partition into ``num_stages`` non-empty stages
    (memoised on the cost model: several methods start from it): cut between blocks unless
    cutting inside them is more than :data:`BLOCK_TOLERANCE` better; with one stage per device,
    solved again with each stage's memory beyond what the split counts (receive buffers,
    temporaries: the simulator's peak less the split's count) reserved, when that predicts a
    faster step once recomputation makes every device fit."""
    if num_stages not in model.contiguous_optimum:
        model.contiguous_optimum[num_stages] = _calibrated(model, num_stages)
    return list(model.contiguous_optimum[num_stages])


def _calibrated(model: CostModel, num_stages: int) -> list[int]:
    split = ContiguousSplits(model, num_stages)
    best, cuts = between_blocks_or_anywhere(split)
    if best is None and model.recomputes_to_balance:
        # the state alone does not fit, whatever is recomputed
        raise memory_error(model.assuming_recomputation(), num_stages)
    if best is None:
        raise memory_error(model, num_stages)
    if model.recomputes_all:
        return best.stage_of_unit
    schedule = model.schedule if model.schedule in ("1f1b", "gpipe") else "1f1b"
    first = model.evaluate(best.stage_of_unit, schedule=schedule)
    reserve = [
        max(0.0, peak - counted)
        for peak, counted in zip(first.device_memory, split.memory(best.stage_of_unit))
    ]
    again = split.solve(cuts, reserve, within=best.bottleneck * (1 + CALIBRATION_LIMIT))
    if again is None or again.stage_of_unit == best.stage_of_unit:
        return best.stage_of_unit
    devices = list(range(num_stages))
    chosen = fastest_fitting(
        model, [(best.stage_of_unit, devices, schedule), (again.stage_of_unit, devices, schedule)]
    )
    return again.stage_of_unit if chosen else best.stage_of_unit


def between_blocks_or_anywhere(
    split: ContiguousSplits,
) -> tuple[SplitOptimum | None, torch.Tensor | None]:
    """The optimum cut between blocks, with those cuts, where its slowest stage is within
    :data:`BLOCK_TOLERANCE` of the optimum cut anywhere (or nothing cuts anywhere); else the
    optimum cut anywhere, with None (None, None: no split). The split between blocks is solved
    first (on the block boundaries alone, a small problem); the one cut anywhere only as far
    as it could beat it by more than the tolerance."""
    blocks = split.solve(split.between_blocks)
    if blocks is None:
        return split.solve(), None
    # no split is faster than its share of the compute (nor than its heaviest unit): a split
    # between blocks within the tolerance of that is within it of any (with a margin for
    # rounding)
    if blocks.bottleneck <= split.least_bottleneck() * (1 + BLOCK_TOLERANCE) * (1 - 1e-9):
        return blocks, split.between_blocks
    # only an optimum below this could make the split between blocks more than the tolerance
    # slower (the margin covers rounding: the test below decides)
    within = blocks.bottleneck / (1 + BLOCK_TOLERANCE) * (1 + 1e-9)
    anywhere = split.solve(within=within)
    if anywhere is None or blocks.bottleneck <= anywhere.bottleneck * (1 + BLOCK_TOLERANCE):
        return blocks, split.between_blocks
    return anywhere, None


@dataclass(frozen=True)
class Tile:
    """The ranges of units i .. j - 1 for starts i in ``rows`` and ends j in ``ends``: what
    stages covering them cost wherever they sit (tensors of rows x ends)."""

    rows: slice
    ends: slice
    compute_forward: torch.Tensor
    forward: torch.Tensor  # the forward, or the transfers around the stage if longer
    backward: torch.Tensor
    cut_backward: torch.Tensor
    plain: torch.Tensor  # the stage's time recomputing nothing
    state: torch.Tensor
    activations: torch.Tensor  # one microbatch's
    savable: torch.Tensor  # one microbatch's
    forward_in_blocks: torch.Tensor
    allowed: torch.Tensor  # the range is a stage (i < j, cut where cuts are allowed)


@dataclass(frozen=True)
class SplitOptimum:
    stage_of_unit: list[int]
    bottleneck: float  # the slowest stage, as the split counts it


class ContiguousSplits:
    """The contiguous splits of one model into ``num_stages`` stages: prefix sums of the units'
    costs, and the exact optimum under optional restrictions (:meth:`solve`)."""

    def __init__(self, model: CostModel, num_stages: int) -> None:
        n = model.num_units
        if num_stages > n:
            raise PartitionError(
                f"{num_stages} stages need at least {num_stages} units, but the graph has {n}; "
                "use fewer stages, or a larger --depth / fewer --basic-blocks so the model "
                "splits into more units"
            )
        self.model, self.num_stages, self.n = model, num_stages, n
        dtype = torch.float64

        def prefix(values: Sequence[float]) -> torch.Tensor:
            out = torch.zeros(n + 1, dtype=dtype)
            out[1:] = torch.cumsum(torch.tensor(values, dtype=dtype), 0)
            return out

        self.fwd, self.bwd = prefix(model.forward), prefix(model.backward)
        self.act, self.par, self.trn = (
            prefix(v) for v in (model.activations, model.param_bytes, model.trainable_bytes)
        )
        # what recomputing blocks can save (their activations less the inputs they keep), and
        # the forward seconds of the units in blocks
        savable, in_blocks = [0.0] * n, [0.0] * n
        self.between_blocks = torch.ones(n + 1, dtype=torch.bool)
        for block in model.blocks.values():
            first, last = min(block.units), max(block.units)
            self.between_blocks[first + 1 : last + 1] = False
            for u in block.units:
                savable[u] += model.activations[u]
                in_blocks[u] += model.forward[u]
            savable[first] -= block.inputs
        self.savable, self.forward_in_blocks = prefix(savable), prefix(in_blocks)
        self.trained, self.frozen = model.state_factors()
        # seconds a stage spends on the cut before its first unit i / after its last unit j - 1,
        # over the slowest link between two pipeline ranks
        link = model.pipeline_link
        self.cut_forward, self.cut_backward = (torch.zeros(n + 1, dtype=dtype) for _ in range(2))
        moved_forward, moved_backward = model.boundary_bytes()
        self.cut_forward[1:n] = torch.tensor([link.transfer(b) for b in moved_forward], dtype=dtype)
        self.cut_backward[1:n] = torch.tensor(
            [link.transfer(b) for b in moved_backward], dtype=dtype
        )
        self.capacity = model.device.memory
        microbatches = model.microbatches or default_microbatches(num_stages)
        self.held = [
            in_flight(k, num_stages, model.schedule, microbatches) for k in range(num_stages)
        ]
        self.positions = torch.arange(n + 1)
        #: the last restriction to cut positions (:meth:`_at`), by the identity of its cuts
        self._restricted: tuple[int, _CutsOnly] | None = None

    def _at(self, cuts: torch.Tensor) -> _CutsOnly:
        """These splits restricted to the positions in ``cuts`` (which hold 0 and the end):
        the runs of units between two such positions as single units, the same sums at the
        same positions, so a solve gives the same optimum as one masked by ``cuts``, with far
        fewer positions to try (a model's blocks, not its units)."""
        key = id(cuts)
        if self._restricted is None or self._restricted[0] != key:
            positions = torch.nonzero(cuts).flatten()
            self._restricted = (key, _CutsOnly(self, positions))
        return self._restricted[1]

    def least_bottleneck(self) -> float:
        """What the slowest stage of any split costs at least: the compute's share of a stage,
        and the heaviest unit's (a stage costs at least its units' forward and backward)."""
        compute = self.fwd + self.bwd
        heaviest = float((compute[1:] - compute[:-1]).max()) if self.n else 0.0
        return max(float(compute[-1]) / self.num_stages, heaviest)

    def memory(self, stage_of_unit: list[int]) -> list[float]:
        """Each stage's training state and activations in flight, as the split counts them."""
        bounds = [0] + [u for u in range(1, self.n) if stage_of_unit[u] != stage_of_unit[u - 1]]
        bounds.append(self.n)
        out = []
        for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
            state = self.model.state_bytes(
                float(self.par[j] - self.par[i]), float(self.trn[j] - self.trn[i])
            )
            out.append(state + float(self.act[j] - self.act[i]) * self.held[k])
        return out

    def tile(self, rows: slice, ends: slice, cuts: torch.Tensor | None) -> Tile:
        """What the stages covering units i .. j - 1 cost whatever their place in the pipeline,
        for starts i in ``rows`` and ends j in ``ends`` (see :meth:`stage_costs`)."""
        i, j = self.positions[rows].unsqueeze(1), self.positions[ends].unsqueeze(0)
        compute_forward = self.fwd[j] - self.fwd[i]
        trainable = self.trn[j] - self.trn[i]
        state = trainable * self.trained + (self.par[j] - self.par[i] - trainable) * self.frozen
        forward = torch.maximum(compute_forward, self.cut_forward[i] + self.cut_forward[j])
        backward = self.bwd[j] - self.bwd[i]
        cut_backward = self.cut_backward[i] + self.cut_backward[j]
        allowed = i < j
        if cuts is not None:
            allowed = allowed & cuts[i] & cuts[j]
        return Tile(
            rows=rows,
            ends=ends,
            compute_forward=compute_forward,
            forward=forward,
            backward=backward,
            cut_backward=cut_backward,
            plain=forward + torch.maximum(backward, cut_backward),
            state=state,
            activations=self.act[j] - self.act[i],
            savable=self.savable[j] - self.savable[i],
            forward_in_blocks=self.forward_in_blocks[j] - self.forward_in_blocks[i],
            allowed=allowed,
        )

    def stage_costs(self, k: int, tile: Tile, room: float) -> torch.Tensor:
        """Cost of stage ``k`` covering the tile's ranges of units, with ``room`` bytes for it
        (see :meth:`costs`)."""
        return self.costs(tile, [k], [room])[0]

    def costs(self, tile: Tile, stages: Sequence[int], rooms: Sequence[float]) -> torch.Tensor:
        """Cost of each stage k of ``stages`` (with ``rooms[k]`` bytes for it) covering the
        tile's ranges of units: stages x rows x ends. Infinite where the tile does not allow
        the range (i >= j, or i or j not among the allowed cuts) or where the stage's training
        state alone does not fit. Transfers overlap compute: max(forward, comm forward) +
        max(backward + forward recomputed, comm backward). Activations beyond the room left
        are recomputed in backward (:func:`recompute_seconds`)."""
        held = torch.tensor([float(self.held[k]) for k in stages], dtype=torch.float64)
        held = held.view(-1, 1, 1)
        room = torch.tensor(list(rooms), dtype=torch.float64).view(-1, 1, 1)
        in_flight = tile.activations * held
        valid = tile.allowed & (tile.state <= room)
        fits = (tile.state + in_flight) <= room
        if bool(fits.all()):
            cost = tile.plain.expand_as(in_flight)
        elif self.model.recomputes_to_balance:
            recomputed = recompute_seconds(
                room - tile.state,
                in_flight,
                tile.savable * held,
                tile.forward_in_blocks,
                tile.compute_forward,
            )
            cost = tile.forward + torch.maximum(tile.backward + recomputed, tile.cut_backward)
        else:
            cost = tile.plain.expand_as(in_flight)
            valid = valid & fits
        return torch.where(valid, cost, torch.full_like(cost, math.inf))

    def _by_stage(self, tile: Tile, rooms: Sequence[float]) -> Iterator[tuple[int, torch.Tensor]]:
        """Each stage k with the tile's costs for it, in order, costed for as many stages at
        once as :data:`COSTED_AT_ONCE` entries allow."""
        size = max(1, tile.plain.numel())
        step = max(1, COSTED_AT_ONCE // size)
        for first in range(0, self.num_stages, step):
            stages = range(first, min(self.num_stages, first + step))
            costs = self.costs(tile, stages, [rooms[k] for k in stages])
            for offset, k in enumerate(stages):
                yield k, costs[offset]

    def solve(
        self,
        cuts: torch.Tensor | None = None,
        reserve: Sequence[float] | None = None,
        within: float | None = None,
    ) -> SplitOptimum | None:
        """The optimum (None if no split is allowed, or none whose slowest stage takes at most
        ``within`` seconds), stages cut only at ``cuts`` (positions between units; None:
        anywhere), stage k's room the device's memory less ``reserve[k]``."""
        if cuts is not None and bool(cuts[0]) and bool(cuts[-1]):
            return self._at(cuts).solve(None, reserve, within)
        return self.solve_masked(cuts, reserve, within)

    def solve_masked(
        self,
        cuts: torch.Tensor | None = None,
        reserve: Sequence[float] | None = None,
        within: float | None = None,
    ) -> SplitOptimum | None:
        """:meth:`solve` over every position, those not in ``cuts`` masked (what :meth:`solve`
        answers on the cut positions alone)."""
        n, num_stages = self.n, self.num_stages
        rooms = [self.capacity - (reserve[k] if reserve else 0.0) for k in range(num_stages)]

        def single(k: int, rows: slice, ends: slice) -> torch.Tensor:
            return self.stage_costs(k, self.tile(rows, ends, cuts), rooms[k])

        # A stage of the optimum costs at most the equal-compute split's slowest stage, and at
        # least its own compute: each end j only needs the starts within that band of compute.
        compute = self.fwd + self.bwd
        bound = _equal_split_bound(compute, num_stages, single, cuts)
        if within is not None:  # splits slower than that are of no use to the caller
            bound = min(bound, within)
        lowest = (
            torch.searchsorted(compute, compute - bound * (1 + 1e-9) - 1e-15)
            if math.isfinite(bound)
            else torch.zeros(n + 1, dtype=torch.long)
        )
        # columns per tile: about the band's width (a tile spans its band and its columns),
        # within bounds on the tiles' number and size
        band = int((torch.arange(n + 1) - lowest).max())
        width = min(max(64, band, (n + 1) // 64), max(1, (1 << 22) // (n + 1)))
        tiles = []
        for first in range(0, n + 1, width):
            ends = slice(first, min(n + 1, first + width))
            tiles.append(self.tile(slice(int(lowest[first]), ends.stop), ends, cuts))

        inf = math.inf
        dtype = torch.float64
        # best[k][j]: least bottleneck covering units 0..j-1 with stages 0..k-1. Tile by tile
        # (in column order), every stage count: a tile's starts lie in its own columns or in
        # earlier tiles', which are done; each tile's costs for all stages at once.
        best = torch.full((num_stages + 1, n + 1), inf, dtype=dtype)
        best[0, 0] = 0.0
        # the second pass reads the same costs: kept from the first, up to COSTS_KEPT entries
        kept: list[torch.Tensor] = []
        room_left = COSTS_KEPT
        for tile in tiles:
            for k, costs in self._by_stage(tile, rooms):
                candidates = torch.maximum(best[k, tile.rows].unsqueeze(1), costs)
                best[k + 1, tile.ends] = candidates.min(0).values
                if room_left >= costs.numel():
                    kept.append(costs)
                    room_left -= costs.numel()
                else:
                    room_left = -1  # the second pass costs them again
        optimum = float(best[num_stages, n])
        if not math.isfinite(optimum) or (within is not None and optimum > within):
            return None
        # among partitions with that bottleneck, the most balanced (least sum of squares);
        # ties -> earliest cut
        limit = optimum * (1 + 1e-9)
        total = torch.full((num_stages + 1, n + 1), inf, dtype=dtype)
        choice = torch.zeros((num_stages + 1, n + 1), dtype=torch.long)
        total[0, 0] = 0.0
        reread = iter(kept)
        for tile in tiles:
            by_stage = (
                self._by_stage(tile, rooms)
                if room_left < 0
                else ((k, next(reread)) for k in range(num_stages))
            )
            for k, costs in by_stage:
                squares = torch.where(costs <= limit, costs * costs, inf)
                value = total[k, tile.rows].unsqueeze(1) + squares
                total[k + 1, tile.ends], index = value.min(0)
                choice[k + 1, tile.ends] = index + tile.rows.start
        stage_of_unit = [0] * n
        j = n
        for k in range(num_stages, 0, -1):
            i = int(choice[k, j])
            for u in range(i, j):
                stage_of_unit[u] = k - 1
            j = i
        return SplitOptimum(stage_of_unit, optimum)


class _CutsOnly(ContiguousSplits):
    """A :class:`ContiguousSplits` whose units are the runs of another's units between the
    given cut positions (0 and the end among them): its prefix sums are the other's at those
    positions. :meth:`solve` answers in the other's units."""

    def __init__(self, whole: ContiguousSplits, positions: torch.Tensor) -> None:
        self.model, self.num_stages = whole.model, whole.num_stages
        self.n = len(positions) - 1
        self.first_unit = positions.tolist()  # of each run, and the end
        for name in ("fwd", "bwd", "act", "par", "trn", "savable", "forward_in_blocks"):
            setattr(self, name, getattr(whole, name)[positions])
        self.cut_forward, self.cut_backward = (
            whole.cut_forward[positions],
            whole.cut_backward[positions],
        )
        self.between_blocks = torch.ones(self.n + 1, dtype=torch.bool)
        self.trained, self.frozen = whole.trained, whole.frozen
        self.capacity, self.held = whole.capacity, whole.held
        self.positions = torch.arange(self.n + 1)
        self._restricted = None
        self.units = whole.n

    def solve(
        self,
        cuts: torch.Tensor | None = None,
        reserve: Sequence[float] | None = None,
        within: float | None = None,
    ) -> SplitOptimum | None:
        assert cuts is None  # every position of these splits is a cut
        runs = self.solve_masked(None, reserve, within)
        if runs is None:
            return None
        stage_of_unit = [0] * self.units
        for run, stage in enumerate(runs.stage_of_unit):
            for unit in range(self.first_unit[run], self.first_unit[run + 1]):
                stage_of_unit[unit] = stage
        return SplitOptimum(stage_of_unit, runs.bottleneck)


def recompute_seconds(
    room: torch.Tensor,
    activations: torch.Tensor,
    savable: torch.Tensor,
    forward_in_blocks: torch.Tensor,
    forward: torch.Tensor,
) -> torch.Tensor:
    """The forward seconds a stage recomputes in backward so that its ``activations`` (bytes of
    all the microbatches it holds in flight) fit in the ``room`` its training state leaves:
    none where they fit; where recomputing its blocks can save enough (``savable`` bytes, at
    ``forward_in_blocks`` seconds), that share of its blocks' forward (the cheapest blocks
    first save more per second: an upper estimate); else its whole forward (the stage
    recomputes whole, keeping only its inputs)."""
    over = activations - room
    share = over / savable.clamp(min=1e-30)
    blocks = forward_in_blocks * share.clamp(0.0, 1.0)
    return torch.where(
        over <= 0, torch.zeros_like(forward), torch.where(over <= savable, blocks, forward)
    )


def _equal_split_bound(
    compute: torch.Tensor,
    num_stages: int,
    stage_costs: Callable[[int, slice, slice], torch.Tensor],
    allowed: torch.Tensor | None = None,
) -> float:
    """The slowest stage (communication and memory included) of the split into stages of equal
    compute (cut at the ``allowed`` positions nearest to equal: a split the DP may choose): an
    upper bound on the optimum's bottleneck, or infinity if a stage does not fit."""
    n = compute.numel() - 1
    targets = compute[-1] * torch.arange(1, num_stages, dtype=compute.dtype) / num_stages
    if allowed is None:
        cuts = torch.searchsorted(compute, targets).clamp(1, n - 1).tolist()
    else:
        positions = torch.nonzero(allowed[1:n]).flatten() + 1
        if len(positions) < num_stages - 1:
            return math.inf
        at = torch.searchsorted(compute[positions], targets).clamp(0, len(positions) - 1)
        cuts = positions[at].tolist()
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
