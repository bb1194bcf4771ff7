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

import re
from dataclasses import dataclass, field

from ..errors import PartitionError
from ..runtime.core.schedules import (
    COMPILE_SCHEDULES,
    MULTI_STAGE,
    Action,
    PipelineCosts,
    ScheduleError,
    event_times,
    greedy_orders,
    peak_memory,
    placement,
    single_stage_order,
)


@dataclass
class Simulation:
    step_time: float
    #: (device, action, start, end) in start order
    events: list[tuple[int, Action, float, float]] = field(default_factory=list)
    peak_memory: list[float] = field(default_factory=list)  # per device
    busy: list[float] = field(default_factory=list)  # per device: seconds computing

    @property
    def bubble(self) -> float:
        """Fraction of device time idle during the step."""
        if not self.busy or self.step_time <= 0:
            return 0.0
        return 1 - sum(self.busy) / (len(self.busy) * self.step_time)


def simulate(orders: dict[int, list[Action]], costs: PipelineCosts) -> Simulation:
    """Run the per-device orders against the costs; raise if they deadlock."""
    try:
        events = event_times(orders, costs)
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    events.sort(key=lambda e: (e[2], e[0]))
    return Simulation(
        step_time=max((e[3] for e in events), default=0.0),
        events=events,
        peak_memory=peak_memory(events, costs),
        busy=[sum(e[3] - e[2] for e in events if e[0] == d) for d in range(costs.num_devices)],
    )


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
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    devices, stages = costs.num_devices, costs.num_stages
    expected = placement(schedule, stages, devices)
    if costs.device_of_stage != expected or stages % devices:
        raise PartitionError(
            f"--schedule {schedule} places stage s on device {expected}; this pipeline has {stages} "
            f"stages on devices {costs.device_of_stage}: use --schedule auto"
        )
    try:
        ops = get_schedule_ops(MULTI_STAGE[schedule], devices, microbatches, stages // devices)
    except Exception as exc:  # torch validates the shape of the schedule
        raise PartitionError(
            f"torch's {schedule} schedule does not fit {stages} stages on {devices} devices with {microbatches} microbatches: {exc}"
        ) from None
    # compute actions only; an overlapped pair "(0F3;3B1)OVERLAP_F_B" runs as its two parts
    return {
        device: [
            Action.parse(part)
            for a in row
            if a is not None
            for part in re.findall(r"\d+[FBIW]\d+", str(a))
            if "REDUCE" not in str(a) and "UNSHARD" not in str(a) and "RESHARD" not in str(a)
        ]
        for device, row in enumerate(ops)
    }
