"""Partitioning: assign units to pipeline stages and stages to devices."""

from __future__ import annotations

from ..errors import PartitionError
from ..graph import Graph
from ..profiling.profile import Profile
from .cost import CostModel, Prediction
from .dp import solve_contiguous
from .partition import Partition

#: --method names -> solvers taking (cost model, stages) and returning stage_of_unit.
METHODS = {"dp": solve_contiguous}
DEFAULT_METHOD = "dp"


def partition(
    graph: Graph,
    profile: Profile,
    num_stages: int,
    *,
    method: str = DEFAULT_METHOD,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    optimizer: str = "adamw",
) -> Partition:
    """Split ``graph`` into ``num_stages`` stages, one per device."""
    if num_stages < 1:
        raise PartitionError(f"--stages must be at least 1, got {num_stages}")
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; available: {', '.join(sorted(METHODS))}")
    model = CostModel(graph, profile, schedule=schedule, microbatches=microbatches, optimizer=optimizer)
    stage_of_unit = METHODS[method](model, num_stages)
    prediction = model.evaluate(stage_of_unit, num_stages)
    return Partition(
        method=method,
        stage_of_unit=stage_of_unit,
        device_of_stage=list(range(num_stages)),
        graph_digest=profile.graph_digest,
        settings={
            "schedule": schedule,
            "microbatches": microbatches or 2 * num_stages,
            "optimizer": optimizer,
            "device": profile.device.name,
            "profile": profile.mode,
        },
        predicted=prediction.to_json(),
    )


__all__ = ["partition", "Partition", "CostModel", "Prediction", "METHODS", "DEFAULT_METHOD"]
