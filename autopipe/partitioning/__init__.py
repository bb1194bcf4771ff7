"""Partitioning: assign units to pipeline stages and stages to devices.

Methods (``--method``): ``dp`` the exact optimum over contiguous splits of the program order;
``metis`` pymetis k-way, repaired into acyclic stages; ``acyclic`` multilevel refinement of
acyclic partitions; ``mpipe`` Mixed-Pipe, which may put several non-adjacent stages on one device.
Every result is a chain of stages (every edge points to the same or a later stage), judged by a
simulated training step under the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import PartitionError
from ..graph import Graph
from ..profiling.profile import Profile
from .acyclic import solve_acyclic
from .cost import CostModel, Prediction
from .dp import solve_contiguous
from .metis import solve_metis
from .mpipe import solve_mpipe
from .partition import Partition
from .refine import looped_devices
from .simulator import SCHEDULES


def solve_dp(model: CostModel, num_stages: int, num_devices: int) -> tuple[list[int], list[int]]:
    return solve_contiguous(model, num_stages), looped_devices(num_stages, num_devices)


#: --method names -> solvers taking (cost model, stages, devices), returning (stage_of_unit, device_of_stage)
METHODS: dict[str, Callable[[CostModel, int, int], tuple[list[int], list[int]]]] = {
    "acyclic": solve_acyclic,
    "dp": solve_dp,
    "metis": solve_metis,
    "mpipe": solve_mpipe,
}
DEFAULT_METHOD = "mpipe"


def default_schedule(device_of_stage: list[int]) -> str:
    """1F1B for one stage per device; the greedy schedule (run by torch's runtime) otherwise."""
    return "1f1b" if device_of_stage == list(range(len(device_of_stage))) else "auto"


def partition(
    graph: Graph,
    profile: Profile,
    num_stages: int,
    *,
    num_devices: int | None = None,
    method: str = DEFAULT_METHOD,
    schedule: str | None = None,
    microbatches: int | None = None,
    optimizer: str = "adamw",
) -> Partition:
    """Split ``graph`` into ``num_stages`` stages on ``num_devices`` devices (default: one each)."""
    num_devices = num_devices or num_stages
    if num_stages < 1:
        raise PartitionError(f"--stages must be at least 1, got {num_stages}")
    if not 1 <= num_devices <= num_stages:
        raise PartitionError(
            f"--devices must be between 1 and the number of stages ({num_stages}), got {num_devices}"
        )
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; available: {', '.join(sorted(METHODS))}")
    if schedule is not None and schedule not in SCHEDULES:
        raise PartitionError(f"unknown schedule {schedule!r}; available: {', '.join(SCHEDULES)}")
    if num_stages > len(graph.units):
        raise PartitionError(
            f"{num_stages} stages need at least {num_stages} units, but the graph has {len(graph.units)}; use "
            "fewer stages, or a larger --depth / fewer --basic-blocks so the model splits into more units"
        )
    model = CostModel(
        graph, profile, schedule=schedule or "1f1b", microbatches=microbatches, optimizer=optimizer
    )
    stage_of_unit, device_of_stage = METHODS[method](model, num_stages, num_devices)
    model.check_monotone(stage_of_unit)
    if sorted(set(stage_of_unit)) != list(range(num_stages)):
        raise PartitionError(
            f"method {method} did not produce {num_stages} non-empty stages (a bug: please report)"
        )
    schedule = schedule or default_schedule(device_of_stage)
    prediction = model.evaluate(stage_of_unit, device_of_stage, schedule)
    costs = model.pipeline_costs(stage_of_unit, device_of_stage)
    return Partition(
        method=method,
        stage_of_unit=stage_of_unit,
        device_of_stage=device_of_stage,
        graph_digest=profile.graph_digest,
        settings={
            "schedule": schedule,
            "microbatches": microbatches or 2 * num_stages,
            "optimizer": optimizer,
            "device": profile.device.name,
            "link": profile.device.link,
            "profile": profile.mode,
        },
        predicted=prediction.to_json(),
        costs={
            "forward": costs.forward,
            "backward": costs.backward,
            "activations": costs.activations,
            "static_memory": costs.static_memory,
            "send_forward": costs.send_forward,
            "send_backward": costs.send_backward,
            "memory_capacity": costs.memory_capacity,
        },
    )


__all__ = [
    "partition",
    "Partition",
    "CostModel",
    "Prediction",
    "METHODS",
    "DEFAULT_METHOD",
    "default_schedule",
]
