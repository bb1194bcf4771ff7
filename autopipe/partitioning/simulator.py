"""Event-driven simulation of one training step of a pipeline under a schedule.

A schedule is, for every device (rank), the order in which it runs its actions: ``F`` (forward),
``B`` (full backward), or ``I``/``W`` (backward for inputs / for weights, in zero-bubble
schedules) of one stage on one microbatch, written like torch's ``_Action`` (``"2F0"``: stage 2,
forward, microbatch 0). Each rank runs its actions in order, an action starting once its rank is
free and its inputs have arrived (activations from the stage before, gradients from the stage
after, after the link's transfer time when the two stages are on different devices). Transfers
overlap compute. The step ends when the last action ends.

The orders come from torch's own schedules (GPipe, 1F1B, and the multi-stage schedules through
``torch.distributed.pipelining``), or from a greedy list scheduler for any stage -> device map
(``"auto"``: the order train.py then runs through torch's schedule runtime).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import PartitionError
from .action_graph import ActionGraph, compile_orders
from ..runtime.core.schedules import (
    COMPILE_SCHEDULES,
    MULTI_STAGE,
    Action,
    PipelineCosts,
    ScheduleError,
    event_times,
    greedy_orders,
    MemoryPeak,
    device_memory,
    placement,
    single_stage_order,
)

#: one simulated action: (device, action, start, end)
Event = tuple[int, Action, float, float]


class Simulation:
    """One simulated step: its time, each device's seconds computing and memory peak, the most
    microbatches of each stage alive at once, and every action's times; each figure but the
    time computed when first read (a partitioner comparing splits reads the time and the
    memory alone)."""

    def __init__(
        self,
        step_time: float,
        busy: list[float] | Callable[[], list[float]],
        memory_peaks: list[MemoryPeak] | Callable[[], list[MemoryPeak]],
        held: list[int] | Callable[[], list[int]],
        events: list[Event] | Callable[[], list[Event]],
    ) -> None:
        self.step_time = step_time
        self._busy, self._memory_peaks, self._held, self._events = busy, memory_peaks, held, events

    @functools.cached_property
    def busy(self) -> list[float]:
        """Per device: seconds computing."""
        return self._busy if isinstance(self._busy, list) else self._busy()

    @functools.cached_property
    def memory_peaks(self) -> list[MemoryPeak]:
        """Per device: what its peak holds."""
        return self._memory_peaks if isinstance(self._memory_peaks, list) else self._memory_peaks()

    @functools.cached_property
    def held(self) -> list[int]:
        """Per stage: the most microbatches alive at once."""
        return self._held if isinstance(self._held, list) else self._held()

    @functools.cached_property
    def events(self) -> list[Event]:
        """``(device, action, start, end)`` of every action, by start (then device)."""
        return self._events if isinstance(self._events, list) else self._events()

    @property
    def peak_memory(self) -> list[float]:
        """Each device's peak bytes."""
        return [peak.total for peak in self.memory_peaks]

    @property
    def bubble(self) -> float:
        """Fraction of device time idle during the step."""
        if not self.busy or self.step_time <= 0:
            return 0.0
        return 1 - sum(self.busy) / (len(self.busy) * self.step_time)


def simulate(orders: dict[int, list[Action]], costs: PipelineCosts) -> Simulation:
    """Run the per-device orders against the costs (the reference event walk); raise if they
    deadlock."""
    try:
        events = event_times(orders, costs)
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    return _simulation(events, costs)


#: whether every simulation walks the events (the reference), bypassing the compiled graphs:
#: see :func:`reference_simulation`
_REFERENCE = [False]


@contextlib.contextmanager
def reference_simulation() -> Iterator[None]:
    """Within the block, :func:`simulate_schedule` runs the reference event walk only (what
    benchmarks/plan_speed.py compares the fast path's plans with)."""
    _REFERENCE.append(True)
    try:
        yield
    finally:
        _REFERENCE.pop()


def simulate_schedule(schedule: str, costs: PipelineCosts, microbatches: int) -> Simulation:
    """:func:`simulate` of ``schedule``'s orders, equal to it to the last bit: the orders of a
    fixed schedule (all but ``auto``, whose greedy orders depend on the costs) are compiled
    once per placement and microbatch count into an :class:`ActionGraph` and timed level by
    level (see :mod:`.action_graph`). The memory walk frees input gradients as ``schedule``
    does (:meth:`PipelineCosts.for_schedule`)."""
    costs = costs.for_schedule(schedule)
    if schedule != "auto" and not _REFERENCE[-1]:
        graph = _compiled(schedule, tuple(costs.device_of_stage), microbatches)
        if graph is not None:
            return _timed(graph, costs)
    return simulate(schedule_orders(schedule, costs, microbatches), costs)


def schedule_memory(schedule: str, costs: PipelineCosts, microbatches: int) -> list[MemoryPeak]:
    """Each device's memory peak under ``schedule``: :func:`simulate_schedule`'s, without
    timing the actions where the orders are compiled (a device's memory depends on its own
    order alone)."""
    costs = costs.for_schedule(schedule)
    if schedule != "auto" and not _REFERENCE[-1]:
        graph = _compiled(schedule, tuple(costs.device_of_stage), microbatches)
        if graph is not None:
            return graph.memory_peaks(costs)
    return simulate_schedule(schedule, costs, microbatches).memory_peaks


def _timed(graph: ActionGraph, costs: PipelineCosts) -> Simulation:
    """The simulation of a compiled schedule, each figure derived from the times' arrays the
    way :func:`_simulation` derives it from the listed events (equal to the last bit), the
    events listed only if asked for."""
    start, end = graph.times(costs)
    return Simulation(
        step_time=float(end.max()) if len(end) else 0.0,
        busy=lambda: graph.busy(start, end, costs.num_devices),
        memory_peaks=lambda: graph.memory_peaks(costs),
        held=lambda: graph.held(start, end, costs.num_stages),
        events=lambda: _by_start(graph.listing(start, end)),
    )


#: compiled schedules kept: a partitioner evaluates one placement and microbatch count many
#: times, a plan search moves on to others (a graph of 64 ranks x 256 microbatches holds tens of
#: megabytes)
COMPILED_KEPT = 8


@functools.lru_cache(maxsize=COMPILED_KEPT)
def _compiled(
    schedule: str, device_of_stage: tuple[int, ...], microbatches: int
) -> ActionGraph | None:
    """The compiled orders of a fixed schedule (None where only the reference runs them)."""
    stages = len(device_of_stage)
    placed = PipelineCosts(
        forward=[0.0] * stages,
        backward=[0.0] * stages,
        activations=[],
        static_memory=[],
        send_forward=[],
        send_backward=[],
        device_of_stage=list(device_of_stage),
    )
    return compile_orders(schedule_orders(schedule, placed, microbatches), stages)


def _simulation(events: list[Event], costs: PipelineCosts) -> Simulation:
    """The simulation of these events, listed as :func:`event_times` lists them."""
    events = _by_start(events)
    busy = [0.0] * costs.num_devices
    for device, _action, start, end in events:
        busy[device] += end - start
    return Simulation(
        step_time=max((e[3] for e in events), default=0.0),
        busy=busy,
        memory_peaks=device_memory(events, costs),
        held=held_microbatches(costs.num_stages, events),
        events=events,
    )


def _by_start(events: list[Event]) -> list[Event]:
    """``events`` sorted in place by start, then device (a stable sort: ties keep the
    reference's listing), as a simulation lists them."""
    events.sort(key=lambda e: (e[2], e[0]))
    return events


def held_microbatches(num_stages: int, events: list[Event]) -> list[int]:
    """Most microbatches of each stage alive at once: from a forward's start to the end of its
    full or weight backward (at equal times, the end first)."""
    changes: list[list[tuple[float, int]]] = [[] for _ in range(num_stages)]
    for _device, action, start, end in events:
        if action.kind == "F":
            changes[action.stage].append((start, 1))
        elif action.kind in ("B", "W"):
            changes[action.stage].append((end, -1))
    peaks = []
    for stage_changes in changes:
        live = peak = 0
        for _time, delta in sorted(stage_changes, key=lambda c: (c[0], c[1])):
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


# -- schedules --------------------------------------------------------------------------------
def schedule_orders(
    schedule: str, costs: PipelineCosts, microbatches: int
) -> dict[int, list[Action]]:
    """Per-device action orders of ``schedule`` for this placement of stages."""
    devices = costs.device_of_stage
    one_per_device = sorted(devices) == list(range(len(devices))) and devices == sorted(devices)
    if schedule in ("gpipe", "1f1b"):
        if not one_per_device:
            raise PartitionError(
                f"--schedule {schedule} runs one stage per device, in order; this pipeline places "
                f"stages on devices {devices}: use --schedule auto (or interleaved-1f1b for a looped placement)"
            )
        return {
            s: single_stage_order(schedule, s, len(devices), microbatches)
            for s in range(len(devices))
        }
    if schedule == "auto":
        try:
            return greedy_orders(costs, microbatches)
        except ScheduleError as exc:
            raise PartitionError(str(exc)) from None
    if schedule in MULTI_STAGE:
        return torch_orders(schedule, costs, microbatches)
    raise PartitionError(f"unknown schedule {schedule!r}; known: {', '.join(COMPILE_SCHEDULES)}")


def torch_orders(schedule: str, costs: PipelineCosts, microbatches: int) -> dict[int, list[Action]]:
    """The action orders of one of torch's multi-stage schedules."""
    devices, stages = costs.num_devices, costs.num_stages
    expected = placement(schedule, stages, devices)
    if costs.device_of_stage != expected or stages % devices:
        raise PartitionError(
            f"--schedule {schedule} places stage s on device {expected}; this pipeline has {stages} "
            f"stages on devices {costs.device_of_stage}: use --schedule auto"
        )
    try:
        orders = _torch_orders(schedule, devices, microbatches, stages // devices)
    except Exception as exc:  # torch validates the shape of the schedule
        raise PartitionError(
            f"torch's {schedule} schedule does not fit {stages} stages on {devices} devices with {microbatches} microbatches: {exc}"
        ) from None
    return {device: list(row) for device, row in enumerate(orders)}


#: orders of torch's schedules kept (a search asks for the same ones again and again, and torch
#: builds each through mocks: tens of milliseconds for a few ranks)
TORCH_ORDERS_KEPT = 64


@functools.lru_cache(maxsize=TORCH_ORDERS_KEPT)
def _torch_orders(
    schedule: str, devices: int, microbatches: int, stages_per_device: int
) -> tuple[tuple[Action, ...], ...]:
    """Each device's compute actions under torch's multi-stage ``schedule`` (the orders are not
    lowered: no unshard, reshard, reduction or send/receive); an overlapped pair
    "(0F3;3B1)OVERLAP_F_B" runs as its two parts."""
    # imported here: torch.distributed.pipelining takes a second to import, and only the
    # multi-stage schedules need it
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(
        _orders_only(MULTI_STAGE[schedule]), devices, microbatches, stages_per_device
    )
    return tuple(tuple(own for a in row if a is not None for own in _computed(a)) for row in ops)


#: the kinds of compute action, as torch's actions name them
_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W"}


def _computed(action: Any) -> list[Action]:
    """The compute actions of one of torch's actions (an ``_Action``): itself, or the parts of
    an overlapped pair ``(0F3;3B1)OVERLAP_F_B``, each run as itself."""
    parts = action.sub_actions if action.sub_actions is not None else (action,)
    return [
        Action(part.stage_index, _KINDS[part.computation_type.value], part.microbatch_index)
        for part in parts
        if part.computation_type.value in _KINDS and part.microbatch_index is not None
    ]


@functools.cache
def _orders_only(name: str) -> type:
    """torch's schedule class ``name`` computing its per-rank orders (and validating them) but
    not lowering them to its runtime's unshard, reshard, reduction and send/receive actions:
    the simulation reads compute actions only, and the lowering takes seconds at 64 ranks
    (tests/test_simulator.py checks the orders equal ``get_schedule_ops``' of the class
    itself)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    base = get_schedule_class(name)

    def validated(self: Any, actions: dict[int, list[Any]], format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)

    return type(base.__name__, (base,), {"_prepare_schedule_with_comms": validated})
