"""Assignments of units to stages that stay acyclic, and local moves that improve them.

Every partitioner here produces a *monotone* assignment: along every edge of the unit DAG (data,
and the order of in-place writes) the stage index never decreases, so the stages form a chain and
values can be relayed from each stage to the next. :class:`Assignment` keeps the per-stage compute
and the bytes crossing each boundary up to date as single units move, so refinement costs
``O(exchanges of the unit x stages)`` per move, and the stages' times and the devices' loads and
memory as they change: a move changes the stages between its source and its destination (the
bytes an exchange moves are whole numbers, so the crossings elsewhere stay exactly as they
were), and an objective costs the devices, not the stages.
"""

from __future__ import annotations

import itertools
import math

from ..errors import PartitionError
from ..runtime.core.pipeline import default_microbatches
from .cost import CostModel, in_flight, stage_time

_EPS = 1e-12


class Assignment:
    """A monotone unit -> stage assignment with a stage -> device map, updated incrementally."""

    def __init__(self, model: CostModel, stage_of_unit: list[int], device_of_stage: list[int]):
        self.model = model
        self.stage = list(stage_of_unit)
        self.device_of_stage = list(device_of_stage)
        self.num_stages = len(device_of_stage)
        self.compute = [0.0] * self.num_stages
        self.forward = [0.0] * self.num_stages
        self.backward = [0.0] * self.num_stages
        self.static = [0.0] * self.num_stages  # parameter, gradient and optimizer bytes
        self.activations = [0.0] * self.num_stages  # bytes one microbatch keeps for backward
        self.size = [0] * self.num_stages
        for unit, s in enumerate(self.stage):
            self._add(unit, s, +1)
        microbatches = model.microbatches or default_microbatches(self.num_stages)
        self.in_flight = [
            in_flight(s, self.num_stages, model.schedule, microbatches)
            for s in range(self.num_stages)
        ]
        # the bytes over boundary s -> s+1 (and back) are the sums of these up to s: a value
        # spanning stages first .. end adds at first and takes back at end, so a move costs
        # the unit's exchanges, not the stages they span
        self.act_change = [0.0] * self.num_stages
        self.grad_change = [0.0] * self.num_stages
        #: each exchange as (producer, last reader, activation bytes, gradient bytes): read in
        #: every trial move, so not through the dataclass's properties
        self._exchanges = [
            (ex.producer, ex.last, ex.activation, ex.gradient) for ex in model.exchanges
        ]
        self.exchanges_of: list[list[int]] = [[] for _ in range(model.num_units)]
        for index, ex in enumerate(model.exchanges):
            if ex.producer >= 0:
                self.exchanges_of[ex.producer].append(index)
            for reader in ex.readers:
                if reader < model.num_units:
                    self.exchanges_of[reader].append(index)
            self._span(index, +1)
        self.preds = [list(model.dag.predecessors(u)) for u in range(model.num_units)]
        self.succs = [list(model.dag.successors(u)) for u in range(model.num_units)]
        self.num_devices = max(self.device_of_stage) + 1
        self.stages_of: list[list[int]] = [[] for _ in range(self.num_devices)]
        for s, d in enumerate(self.device_of_stage):
            self.stages_of[d].append(s)
        self._links = model.boundary_links(tuple(self.device_of_stage))
        # the stages' times and the devices' loads and memory, brought up to date when read:
        # the stages changed since (first, last), None where none did
        self._times = [0.0] * self.num_stages
        self._loads = [0.0] * self.num_devices
        self._memory = [0.0] * self.num_devices
        self._changed: tuple[int, int] | None = (0, self.num_stages - 1)

    # -- bookkeeping --------------------------------------------------------------------------
    def _add(self, unit: int, stage: int, sign: int) -> None:
        model = self.model
        self.compute[stage] += sign * model.compute[unit]
        self.forward[stage] += sign * model.forward[unit]
        self.backward[stage] += sign * model.backward[unit]
        self.static[stage] += sign * model.unit_state[unit]
        self.activations[stage] += sign * model.activations[unit]
        self.size[stage] += sign

    def _span(self, index: int, sign: int) -> None:
        producer, last, activation, gradient = self._exchanges[index]
        stage = self.stage
        first = stage[producer] if producer >= 0 else 0
        end = stage[last] if last < len(stage) else self.num_stages - 1
        if first < end:
            act, grad = self.act_change, self.grad_change
            act[first] += sign * activation
            act[end] -= sign * activation
            grad[first] += sign * gradient
            grad[end] -= sign * gradient

    def move(self, unit: int, to: int) -> None:
        """Move one unit to stage ``to`` (the caller keeps the assignment monotone)."""
        source = self.stage[unit]
        if source == to:
            return
        touched = self.exchanges_of[unit]
        for index in touched:
            self._span(index, -1)
        self._add(unit, source, -1)
        self.stage[unit] = to
        self._add(unit, to, +1)
        for index in touched:
            self._span(index, +1)
        first, last = min(source, to), max(source, to)
        if self._changed is not None:
            first, last = min(first, self._changed[0]), max(last, self._changed[1])
        self._changed = (first, last)

    # -- costs --------------------------------------------------------------------------------
    def crossings(self) -> tuple[list[float], list[float]]:
        """The bytes over each boundary s -> s+1 (activations), and back (gradients)."""
        act, grad = list(itertools.accumulate(self.act_change)), list(
            itertools.accumulate(self.grad_change)
        )
        return act[:-1], grad[:-1]

    def stage_times(self) -> list[float]:
        """One microbatch's seconds through each stage, its transfers overlapping its compute."""
        self._update()
        return list(self._times)

    def device_loads(self) -> list[float]:
        """Each device's stage times summed."""
        self._update()
        return list(self._loads)

    def device_memory(self) -> list[float]:
        """Each device's training state and the activations its stages keep in flight."""
        self._update()
        return list(self._memory)

    def _update(self) -> None:
        """Bring the changed stages' times, and their devices' loads and memory, up to date
        (each device's sums over its stages in order, as if costed afresh)."""
        if self._changed is None:
            return
        first, last = self._changed
        self._changed = None
        act_crossing, grad_crossing = self.crossings()
        links, times, end = self._links, self._times, self.num_stages - 1
        for k in range(first, last + 1):
            comm_forward = comm_backward = 0.0
            for b in (k - 1, k):  # the boundaries before and after stage k
                link = links[b] if 0 <= b < end else None
                if link is not None:
                    comm_forward += link.transfer(act_crossing[b])
                    comm_backward += link.transfer(grad_crossing[b])
            times[k] = stage_time(self.forward[k], self.backward[k], comm_forward, comm_backward)
        devices = sorted({self.device_of_stage[k] for k in range(first, last + 1)})
        for d in devices:
            load = memory = 0.0
            for s in self.stages_of[d]:
                load += times[s]
                memory += self.static[s] + self.activations[s] * self.in_flight[s]
            self._loads[d], self._memory[d] = load, memory

    def objective(self) -> tuple[float, float, float]:
        """(bytes over device memory, busiest device, sum of squared loads): fit first, then
        speed, then balance as a tie-break."""
        self._update()
        capacity = self.model.device.memory
        overflow = sum(max(0.0, m - capacity) for m in self._memory)
        loads = self._loads
        return overflow, max(loads), sum(x * x for x in loads)


def better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Is objective ``a`` lexicographically better than ``b`` (with a relative tolerance)?"""
    for x, y in zip(a, b):
        if x < y * (1 - 1e-9) - _EPS:
            return True
        if x > y * (1 + 1e-9) + _EPS:
            return False
    return False


def refine(
    state: Assignment, groups: list[list[int]] | None = None, passes: int = 8, patience: int = 24
) -> None:
    """Fiduccia-Mattheyses style refinement: repeatedly make the best move of a group of units
    (by default each unit alone) on or next to the busiest device, to any stage between its last
    predecessor's and its first successor's (at most two stages away), even if it makes things
    worse; lock the group; finally roll back to the best state seen. Every move keeps all edges
    pointing to the same or a later stage."""
    groups = groups if groups is not None else [[u] for u in range(state.model.num_units)]
    moves = _Frontier(state, groups)
    for _ in range(passes):
        start = state.objective()
        best, best_length = start, 0
        history: list[tuple[int, int]] = []  # (group, stage it came from)
        locked: set[int] = set()
        since_best = 0
        while since_best < patience:
            move = moves.best(locked)
            if move is None:
                break
            group, to = move
            history.append((group, moves.stage(group)))
            moves.move(group, to)
            locked.add(group)
            current = state.objective()
            if better(current, best):
                best, best_length, since_best = current, len(history), 0
            else:
                since_best += 1
        for group, source in reversed(history[best_length:]):
            moves.move(group, source)
        if not better(best, start):
            return


class _Frontier:
    """Groups of units that can move: only a group with no predecessor (or no successor) in its
    own stage can leave it without an edge pointing backwards. Kept per stage, updated as groups
    move, so finding the best move costs the size of the frontier, not of the graph."""

    def __init__(self, state: Assignment, groups: list[list[int]]):
        self.state = state
        self.groups = groups
        group_of = {u: g for g, members in enumerate(groups) for u in members}
        self.preds: list[list[int]] = []
        self.succs: list[list[int]] = []
        for g, members in enumerate(groups):
            self.preds.append(sorted({group_of[p] for m in members for p in state.preds[m]} - {g}))
            self.succs.append(sorted({group_of[n] for m in members for n in state.succs[m]} - {g}))
        self.same_preds = [
            sum(self.stage(p) == self.stage(g) for p in self.preds[g]) for g in range(len(groups))
        ]
        self.same_succs = [
            sum(self.stage(n) == self.stage(g) for n in self.succs[g]) for g in range(len(groups))
        ]
        self.frontier: list[set[int]] = [set() for _ in range(state.num_stages)]
        for g in range(len(groups)):
            self._file(g)

    def stage(self, group: int) -> int:
        return self.state.stage[self.groups[group][0]]

    def _file(self, group: int) -> None:
        stage = self.stage(group)
        self.frontier[stage].discard(group)
        if self.same_preds[group] == 0 or self.same_succs[group] == 0:
            self.frontier[stage].add(group)

    def move(self, group: int, to: int) -> None:
        source = self.stage(group)
        for neighbours, counts in (
            (self.preds[group], self.same_succs),
            (self.succs[group], self.same_preds),
        ):
            for n in neighbours:
                at = self.stage(n)
                counts[n] += (at == to) - (at == source)
        self.frontier[source].discard(group)
        for unit in self.groups[group]:
            self.state.move(unit, to)
        self.same_preds[group] = sum(self.stage(p) == to for p in self.preds[group])
        self.same_succs[group] = sum(self.stage(n) == to for n in self.succs[group])
        for n in (*self.preds[group], *self.succs[group], group):
            self._file(n)

    def best(self, locked: set[int]) -> tuple[int, int] | None:
        state = self.state
        loads = state.device_loads()
        busiest = max(range(len(loads)), key=loads.__getitem__)
        hot = {s for s, d in enumerate(state.device_of_stage) if d == busiest}
        near = {s for h in hot for s in range(h - 2, h + 3) if 0 <= s < state.num_stages}
        best_move, best_value = None, None
        for stage in sorted(near):
            for group in sorted(self.frontier[stage]):
                if group in locked or state.size[stage] <= len(self.groups[group]):
                    continue  # locked, or it would empty its stage
                # anywhere between the last predecessor's stage and the first successor's
                low = max((self.stage(p) for p in self.preds[group]), default=0)
                high = min((self.stage(n) for n in self.succs[group]), default=state.num_stages - 1)
                for to in range(max(low, stage - 2), min(high, stage + 2) + 1):
                    if to == stage or not (stage in hot or to in hot):
                        continue
                    for unit in self.groups[group]:
                        state.move(unit, to)
                    value = state.objective()
                    for unit in self.groups[group]:
                        state.move(unit, stage)
                    if best_value is None or better(value, best_value):
                        best_move, best_value = (group, to), value
        return best_move


# -- repair -----------------------------------------------------------------------------------
def monotone(model: CostModel, rank_of_unit: list[float]) -> list[int]:
    """Turn any unit -> part ranking into a monotone assignment: in topological (program) order,
    a unit goes to its own part's rank or the latest stage of its predecessors, whichever is later.
    """
    stage = [0] * model.num_units
    for unit in range(model.num_units):  # program order is a topological order of the unit DAG
        wanted = int(rank_of_unit[unit])
        stage[unit] = max([wanted] + [stage[p] for p in model.dag.predecessors(unit)])
    return stage


def exact_stage_count(model: CostModel, stage: list[int], num_stages: int) -> list[int]:
    """Renumber stages densely, then split the heaviest stages (along program order, at the
    point that balances compute) until there are ``num_stages`` non-empty ones."""
    used = sorted(set(stage))
    renumber = {s: i for i, s in enumerate(used)}
    stage = [renumber[s] for s in stage]
    while max(stage) + 1 < num_stages:
        counts = [stage.count(s) for s in range(max(stage) + 1)]
        loads = [0.0] * len(counts)
        for unit, s in enumerate(stage):
            loads[s] += model.compute[unit]
        splittable = [s for s in range(len(counts)) if counts[s] > 1]
        if not splittable:
            raise PartitionError(
                f"cannot make {num_stages} non-empty stages from {model.num_units} units"
            )
        target = max(splittable, key=lambda s: (loads[s], -s))
        members = [u for u in range(model.num_units) if stage[u] == target]
        half, running, cut = loads[target] / 2, 0.0, 1
        for i, unit in enumerate(members[:-1]):
            running += model.compute[unit]
            cut = i + 1
            if running >= half:
                break
        tail = set(members[cut:])
        # the tail and everything after it moves one stage later (program order keeps it monotone)
        stage = [s + 1 if (s > target or u in tail) else s for u, s in enumerate(stage)]
    return stage


def looped_devices(num_stages: int, num_devices: int) -> list[int]:
    """Stage s on device s mod D: the placement of torch's looped / interleaved schedules."""
    return [s % num_devices for s in range(num_stages)]


def balanced_ranks(model: CostModel, num_parts: int) -> list[int]:
    """A part index per unit cutting program order into pieces of equal compute."""
    total = sum(model.compute) or 1.0
    ranks: list[int] = []
    running = 0.0
    for c in model.compute:
        ranks.append(min(num_parts - 1, math.floor(running / total * num_parts)))
        running += c
    return ranks
